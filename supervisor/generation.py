"""One generation through the supervisor: the internal path that the gRPC and the HTTP API both take.

``Generation`` acquires the model (loading it on demand and waiting while it
starts or restarts, within the request's deadline), forwards the request to
its runner, streams the runner's chunks and records the metrics. When the
runner dies under a request that has not streamed anything yet, the request
waits for the restart and is sent again (at most ``MAX_RESENDS`` times).
Once tokens have gone out, a plain-text answer is resumed once: the restarted
runner gets the prompt plus the tokens sent (``resume_ids``) and goes on, so
the client sees a pause, not an error, and greedy output is the uninterrupted
one; a second death, or an answer under a grammar or with tools, gives the
client the failure, naming the model and the cause. Every failure is a ``ServiceError`` (``common.status``),
which each API turns into its own status.

A generation is iterated with ``async for`` on the supervisor's front door
(``supervisor.front_door``): its runner call is a grpc.aio call on the same
loop, so relaying a chunk costs no thread hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc

from common.errors import InvalidRequest
from common.protocol import runner_pb2
from common.requests import check_message
from common.settings import adapter_folders
from common.status import Code, ServiceError, status_of

from .runners import ManagedRunner, State

log = logging.getLogger("supervisor")

MAX_RESENDS = 3
NO_DEADLINE = 10 * 365 * 86400.0
# Runner answers passed through unchanged: they are about the request, not the runner.
PASSED_THROUGH = {
    Code.INVALID_ARGUMENT,
    Code.RESOURCE_EXHAUSTED,
    Code.DEADLINE_EXCEEDED,
    Code.PERMISSION_DENIED,
    Code.NOT_FOUND,
}


class RunnerCancelled(grpc.RpcError):
    """A runner call cancelled here (the client went away, or the memory policy restarts the runner), as the
    RpcError it is: grpc.aio raises CancelledError in the task reading a call cancelled locally."""

    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "cancelled by the supervisor"


class Generation:
    """One request's way through the supervisor, iterated with ``async for`` on the front door's loop."""

    def __init__(self, supervisor, request, timeout: float | None):
        """``request`` is a supervisor GenerateRequest; ``timeout`` None waits as long as a model takes to start."""
        self.sup = supervisor
        self.request = request
        if timeout is not None and timeout > NO_DEADLINE:
            timeout = None  # gRPC's time_remaining() without a deadline is ~2**63 s, which no timer takes
        self.deadline = None if timeout is None else time.monotonic() + timeout
        runners = supervisor.scheduler.runners
        self.model = request.model or (next(iter(runners)) if len(runners) == 1 else "")
        self.model, adapter = with_adapter(supervisor.config, self.model)
        if adapter:  # "NAME:ADAPTER": the model, with one of its LoRA adapters
            request.model, request.adapter = self.model, adapter
        self._cancelled = threading.Event()
        self._active = None  # (runner, RunnerCall) while a runner call streams
        self.tokens = 0  # streamed so far
        self.sent_ids: list[int] = []  # the answer's tokens streamed so far (a resume goes on from them)
        self.sent_text = 0  # and the characters of its text
        self.resumed = 0  # tokens a resumed runner was given as the answer so far (0: not resumed)

    def cancel(self) -> None:
        """The client went away: stop the runner's generation (it stops within one round). From any thread.

        The runner's call stops counting as in flight here, not when this generation's iterator is finished: a
        server may drop an iterator it no longer reads without closing it, and then only the cyclic garbage
        collector would close it, whenever that runs."""
        self._cancelled.set()
        active = self._active
        if active is not None:
            runner, call = active
            call.cancel()
            runner.untrack(call)

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    async def collect(self) -> list:
        """Every chunk of the answer."""
        return [chunk async for chunk in self]

    def __aiter__(self):
        return self._stream()

    def _sampling_defaults(self) -> None:
        """The model's sampling defaults (its config's ``sampling`` table) in the fields the client left out."""
        model = self.sup.config.models.get(self.model)
        for name in self.request.defaulted if model is not None else ():
            if name in model.sampling:
                setattr(self.request, name, model.sampling[name])

    def _forwarded(self) -> runner_pb2.GenerateRequest:
        forwarded = runner_pb2.GenerateRequest.FromString(self.request.SerializeToString())
        forwarded.DiscardUnknownFields()  # the model field; all others share their numbers
        if self.resumed:  # the answer so far, for the runner to go on from
            del forwarded.resume_ids[:]
            forwarded.resume_ids.extend(self.sent_ids)
            forwarded.resume_text = self.sent_text
        return forwarded

    @property
    def resumable(self) -> bool:
        """An answer under way that a restarted runner can go on with: plain text (no grammar, no tools), once."""
        request = self.request
        return (
            not self.resumed and not request.grammar and not request.tools and not request.resume_ids and request.n <= 1
        )

    def _as_one_answer(self, chunk):
        """A resumed runner's chunk as the one answer's: its usage counts the original prompt, and the tokens
        the first runner gave are the answer's."""
        if self.resumed:
            if chunk.prompt_tokens:
                chunk.prompt_tokens -= self.resumed
            if chunk.HasField("stats"):
                chunk.stats.prompt_tokens -= self.resumed
                chunk.stats.generated_tokens += self.resumed
        return chunk

    async def _stream(self):
        """The answer's chunks; the request is counted in the metrics by how it ended. One generator, not
        layers of them: every layer costs each relayed chunk a step of the loop."""
        code = "OK"
        try:
            self._sampling_defaults()
            try:
                check_message(self.request)  # before a model is looked for: a bad request loads nothing
            except InvalidRequest as error:
                raise status_of(error) from None
            metrics = self.sup.metrics
            generated = metrics.generated
            front = self.sup.front
            resends = 0
            while True:
                if self._cancelled.is_set():
                    raise ServiceError(Code.CANCELLED, "client went away")
                timeout = self.remaining()
                runner = await front.acquire(self.sup.scheduler, self.model, timeout, self._cancelled)
                started = time.perf_counter()
                call = front.runner_call(runner, self._forwarded(), self.remaining())
                runner.track(call)
                self._active = (runner, call)
                if self._cancelled.is_set():
                    call.cancel()
                pid = runner.pid
                first = True
                try:
                    try:
                        async for chunk in call.call:
                            if first:
                                metrics.ttft.labels(self.model).observe(time.perf_counter() - started)
                                first = False
                            chunk = self._as_one_answer(chunk)
                            relayed = len(chunk.token_ids)
                            self.tokens += relayed
                            generated[self.model] = generated.get(self.model, 0) + relayed
                            self.sent_ids += chunk.token_ids
                            self.sent_text += len(chunk.text)
                            if chunk.HasField("stats"):
                                metrics.finished(self.model, chunk.stats)
                            yield chunk
                        return
                    except asyncio.CancelledError:
                        if asyncio.current_task().cancelling() or not call.cancelled:
                            raise  # this task is cancelled (its client went away): not the call alone
                        raise RunnerCancelled() from None
                except grpc.RpcError as error:
                    failure, runner_went_away = await self._failure(runner, call, error)
                    if (
                        runner_went_away
                        and self.tokens == 0
                        and resends < MAX_RESENDS
                        and not self.sup.shutting_down.is_set()
                        and (timeout is None or self.remaining() > 0)
                    ):
                        resends += 1
                        log.info(
                            "model %s: runner went away before the first token (%s); sending the request "
                            "again once it is back",
                            self.model,
                            failure.message,
                        )
                        await self._wait_for_replacement(runner, pid)
                        continue
                    if (
                        runner_went_away
                        and self.tokens > 0
                        and self.resumable
                        and not self.sup.shutting_down.is_set()
                        and (timeout is None or self.remaining() > 0)
                    ):
                        # Resume: the restarted runner goes on from the tokens sent (the client sees a pause).
                        self.resumed = len(self.sent_ids)
                        log.warning(
                            "model %s: runner went away after %d tokens (%s); resuming the answer once it is back",
                            self.model,
                            self.resumed,
                            failure.message,
                        )
                        self.sup.metrics.resumes.labels(self.model).inc()
                        await self._wait_for_replacement(runner, pid)
                        continue
                    raise failure from None
                finally:
                    self._active = None
                    if not call.call.done():
                        call.cancel()
                    runner.untrack(call)
        except ServiceError as error:
            code = error.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        finally:
            if code == "OK" and self._cancelled.is_set():
                code = "CANCELLED"
            self.sup.metrics.requests.labels(self.model or "-", code).inc()

    async def _failure(self, runner: ManagedRunner, call, error: grpc.RpcError) -> tuple[ServiceError, bool]:
        """What the client is told, and whether the runner went away (so the request may be sent again)."""
        code = error.code()
        if self.sup.shutting_down.is_set():
            return ServiceError(
                Code.UNAVAILABLE,
                f"model {self.model}: supervisor shutting down; the generation was cut off after {self.tokens} tokens",
            ), False
        if runner.failure_for(call) is None and code in PASSED_THROUGH:
            return ServiceError.from_details(code, error.details() or code.name), False
        if self._cancelled.is_set():
            return ServiceError(Code.CANCELLED, "client went away"), False
        # The runner went away under the request: say which model and why.
        if runner.failure_for(call) is None:
            await until(runner.exited.is_set, 1.0)
        failure = runner.failure_for(call)
        if failure is not None:
            status, message = failure
            # A hard memory limit restarted it because of this request: sending it again would do the same.
            return ServiceError(status, message), status == Code.UNAVAILABLE
        gone = runner.pid == 0 or runner.state != State.SERVING
        return ServiceError(Code.UNAVAILABLE, f"model {self.model}: {error.details() or code.name}"), gone

    async def _wait_for_replacement(self, runner: ManagedRunner, old_pid: int) -> None:
        """Until the supervisor has noticed the death (then ``acquire`` waits for the restart)."""
        await until(lambda: not (runner.state == State.SERVING and runner.pid in (0, old_pid)), 2.0)


async def until(predicate, timeout: float, interval: float = 0.02) -> bool:
    """Whether ``predicate()`` came true within ``timeout`` seconds, polled without blocking the loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


def with_adapter(config, name: str) -> tuple[str, str]:
    """(model, adapter) a request's model names: "NAME:ADAPTER" where ADAPTER is one of the configured model
    NAME's LoRA adapters (its ``adapters`` setting); the name as it is, with no adapter, otherwise (a hub
    repository's "org/name:Q4_K_M" among them)."""
    base, _, adapter = name.rpartition(":")
    model = config.models.get(base)
    if model is not None and adapter in adapter_folders(model.runner.adapters):
        return base, adapter
    return name, ""


def count_tokens(supervisor, request, timeout: float = 120.0) -> int:
    """The prompt's tokens as its generation would lay it out (the runner's CountTokens: chat template and
    tools), loading the model on demand; errors as a generation's (``ServiceError``)."""
    try:
        check_message(request)
    except InvalidRequest as error:
        raise status_of(error) from None
    runners = supervisor.scheduler.runners
    model, adapter = with_adapter(
        supervisor.config, request.model or (next(iter(runners)) if len(runners) == 1 else "")
    )
    if adapter:
        request.model, request.adapter = model, adapter
    forwarded = runner_pb2.GenerateRequest.FromString(request.SerializeToString())
    forwarded.DiscardUnknownFields()
    with supervisor.scheduler.acquire(model, timeout=timeout) as runner:
        try:
            return runner.client.stub.CountTokens(forwarded, timeout=timeout).prompt_tokens
        except grpc.RpcError as error:
            code, details = error.code(), error.details() or error.code().name
            if code in PASSED_THROUGH:
                raise ServiceError.from_details(code, details) from None
            raise ServiceError(Code.UNAVAILABLE, f"model {model}: {details}") from None
