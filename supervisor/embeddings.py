"""Embed and Rerank through the supervisor: the internal path the gRPC API and the HTTP APIs (OpenAI's
/v1/embeddings, Ollama's /api/embed and /api/embeddings, /v1/rerank) take, as ``supervisor.generation`` is
for generations.

A request is checked (inputs, counts, characters: ``common.embedding``) before any model is looked for, and its
model's kind is read from its folder (``common.embedding.model_kind``), so asking a generation model for embeddings
is a 400 naming the model without loading it. The model is then acquired as a generation's is (loaded on demand,
LRU, keep-alive, in flight while the call runs), and its inputs go to the runner in calls of at most
``CALL_INPUTS`` (together, on the front door's loop: the runner packs them into its batches with every other
request's, and no message nears gRPC's size limit). A runner that goes away under a call (a crash, a memory
restart) has the request sent again once it is back, at most ``MAX_RESENDS`` times: embedding is idempotent.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.embedding import MAX_INPUTS, MAX_TOTAL_CHARS, model_kind, not_this_kind
from common.errors import InvalidRequest
from common.protocol import runner_pb2
from common.status import Code, ServiceError, status_of

from .front_door import RunnerCall
from .generation import MAX_RESENDS, NO_DEADLINE, PASSED_THROUGH, until
from .runners import State

log = logging.getLogger("supervisor")

CALL_INPUTS = 128  # inputs in one runner call at most
FIELDS = {"input", "dimensions", "prompt_name", "query", "documents", "model"}  # what a runner's refusal may name


def kind_of(supervisor, model: str) -> str:
    """What a model does, from its folder (no runner needed); "generate" for one not known here yet."""
    runner = supervisor.scheduler.runners.get(model)
    if runner is None:
        return "generate" if model in supervisor.config.models else "unknown"
    if runner.info is not None and runner.info.kind:
        return runner.info.kind
    settings = runner.model.runner
    return model_kind(settings.target, settings.kind)


def _model(supervisor, name: str) -> str:
    runners = supervisor.scheduler.runners
    return name or (next(iter(runners)) if len(runners) == 1 else "")


def _check_counts(count: int, characters: int, field: str) -> None:
    if count > MAX_INPUTS:
        raise status_of(InvalidRequest(field, f"{count} inputs: at most {MAX_INPUTS} in one request"))
    if characters > MAX_TOTAL_CHARS:
        raise status_of(InvalidRequest(field, f"{characters} characters: at most {MAX_TOTAL_CHARS} in one request"))


async def embed(supervisor, request, timeout: float | None = None) -> runner_pb2.EmbedResponse:
    """A supervisor EmbedRequest answered: the runner's EmbedResponse, the inputs' vectors in order."""
    model = _model(supervisor, request.model)
    count = len(request.texts) or len(request.token_ids)
    _check_counts(count, sum(map(len, request.texts)), "input")
    if count == 0:
        raise status_of(InvalidRequest("input", "no input to embed: give a string or a non-empty list"))
    forwarded = runner_pb2.EmbedRequest.FromString(request.SerializeToString())
    forwarded.DiscardUnknownFields()
    parts = []
    for start in range(0, count, CALL_INPUTS):
        part = runner_pb2.EmbedRequest()
        part.CopyFrom(forwarded)
        if request.texts:
            del part.texts[:]
            part.texts.extend(request.texts[start : start + CALL_INPUTS])
        else:
            del part.token_ids[:]
            part.token_ids.extend(request.token_ids[start : start + CALL_INPUTS])
        parts.append(part)
    answers = await _calls(supervisor, model, "embed", "Embed", parts, timeout, count)
    if len(answers) == 1:
        return answers[0]
    whole = runner_pb2.EmbedResponse()
    for answer in answers:
        whole.embeddings.extend(answer.embeddings)
        whole.prompt_tokens += answer.prompt_tokens
        whole.truncated += answer.truncated
    return whole


async def rerank(supervisor, request, timeout: float | None = None) -> runner_pb2.RerankResponse:
    """A supervisor RerankRequest answered: one score per document, in order."""
    model = _model(supervisor, request.model)
    count = len(request.documents)
    _check_counts(count, len(request.query) + sum(map(len, request.documents)), "documents")
    forwarded = runner_pb2.RerankRequest.FromString(request.SerializeToString())
    forwarded.DiscardUnknownFields()
    parts = []
    for start in range(0, max(1, count), CALL_INPUTS):
        part = runner_pb2.RerankRequest()
        part.CopyFrom(forwarded)
        del part.documents[:]
        part.documents.extend(request.documents[start : start + CALL_INPUTS])
        parts.append(part)
    answers = await _calls(supervisor, model, "rerank", "Rerank", parts, timeout, count)
    whole = runner_pb2.RerankResponse()
    for answer in answers:
        whole.scores.extend(answer.scores)
        whole.prompt_tokens += answer.prompt_tokens
        whole.truncated += answer.truncated
    return whole


async def _calls(supervisor, model: str, kind: str, method: str, parts: list, timeout, count: int) -> list:
    """Every part through the model's runner, together; metrics by how the request ended."""
    metrics, code = supervisor.metrics, "OK"
    started = time.perf_counter()
    try:
        if not model:
            raise ServiceError(Code.INVALID_ARGUMENT, "model: name the model", "model")
        has = kind_of(supervisor, model)
        if has in ("generate", "embed", "rerank") and has != kind:
            asked = {"embed": "embeddings", "rerank": "rerank"}[kind]
            raise status_of(not_this_kind(model, has, asked))
        deadline = None if timeout is None or timeout > NO_DEADLINE else time.monotonic() + timeout
        answers = await asyncio.gather(*(_call(supervisor, model, method, part, deadline) for part in parts))
        metrics.embedded_request(model, count, sum(a.prompt_tokens for a in answers), time.perf_counter() - started)
        return answers
    except ServiceError as error:
        code = error.code.name
        raise
    except asyncio.CancelledError:
        code = "CANCELLED"
        raise
    finally:
        metrics.embed_requests.labels(model or "-", kind, code).inc()


async def _call(supervisor, model: str, method: str, request, deadline: float | None):
    front = supervisor.front
    resends = 0
    while True:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        runner = await front.acquire(supervisor.scheduler, model, remaining)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        call = RunnerCall(getattr(front.stub(runner), method)(request, timeout=remaining), front.loop)
        runner.track(call)
        pid = runner.pid
        try:
            return await call.call
        except (grpc.RpcError, asyncio.CancelledError) as raised:
            if isinstance(raised, asyncio.CancelledError):
                if asyncio.current_task().cancelling() or not call.cancelled:
                    raise
            error_code = raised.code() if isinstance(raised, grpc.RpcError) else Code.CANCELLED
            details = (raised.details() if isinstance(raised, grpc.RpcError) else "") or error_code.name
            failure = runner.failure_for(call)
            if failure is None and error_code in PASSED_THROUGH:
                error = ServiceError.from_details(error_code, details)
                field = details.split(":", 1)[0]
                if error.param is None and field in FIELDS:
                    error.param = field
                raise error from None
            if supervisor.shutting_down.is_set():
                raise ServiceError(Code.UNAVAILABLE, f"model {model}: supervisor shutting down") from None
            if failure is None:
                await until(runner.exited.is_set, 1.0)
                failure = runner.failure_for(call)
            gone = failure is not None or runner.pid != pid or runner.state != State.SERVING
            if resends < MAX_RESENDS and gone and (deadline is None or time.monotonic() < deadline):
                resends += 1
                log.info(
                    "model %s: runner went away under %s (%s); sending it again once it is back", model, method, details
                )
                await until(lambda r=runner, old=pid: not (r.state == State.SERVING and r.pid in (0, old)), 2.0)
                continue
            status, message = failure if failure is not None else (Code.UNAVAILABLE, f"model {model}: {details}")
            raise ServiceError(status, message) from None
        finally:
            runner.untrack(call)
