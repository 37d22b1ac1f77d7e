"""What every HTTP API adapter of the supervisor shares (OpenAI's, Anthropic's): the strict request schema base,
the one internal request they build, the speculation figures, tool calls put together from their deltas, and
the server-sent event stream that cancels its generation however it ends."""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import math
import secrets
import threading
from typing import Annotated

from fastapi.responses import StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator
from starlette.concurrency import run_in_threadpool

from common.protocol import runner_pb2
from common.requests import NOT_UNICODE, check_fields, is_unicode
from common.status import Code, ServiceError

from .protocol import supervisor_pb2

log = logging.getLogger("supervisor")
# The HTTP request's id (``RequestIds``): the internal request's request_id, its x-request-id header and its log lines.
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
APIS = (("/v1/messages", "Anthropic"), ("/v1/responses", "OpenAI Responses"), ("/api/", "Ollama"), ("/v1/", "OpenAI"))


class RequestIds:
    """ASGI middleware: every HTTP request gets an id (the client's ``x-request-id`` when it sends a short one),
    which its answer carries as ``x-request-id`` and its generation as its request_id, so a client's failure can
    be found in the log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if 0 < len(given) <= 64 and given.isprintable() else f"http-{secrets.token_hex(6)}"
        token = REQUEST_ID.set(request_id)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


async def while_connected(request, work, on_disconnect=None):
    """``await work`` (an awaitable), watching the client meanwhile. One that disconnects calls ``on_disconnect``
    (a generation's cancel: it ends within a round, and ``work`` returns what it made) or, without one, cancels
    ``work`` and refuses with CANCELLED (an embedding or rerank: with it goes its wait for a place, where the runner
    making room for it takes no new requests)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if not done and await request.is_disconnected():
                if on_disconnect is None:
                    task.cancel()
                    raise ServiceError(Code.CANCELLED, "the client closed the request")
                on_disconnect()
        return task.result()
    except asyncio.CancelledError:
        if on_disconnect is not None:
            on_disconnect()
        task.cancel()
        raise


async def load_while_connected(request, scheduler, model: str, only: bool = False) -> None:
    """Start ``model``'s runner and wait until it serves (an Ollama request with nothing to answer loads the model),
    watching the client meanwhile: one that disconnects ends the wait (``Scheduler.load``'s ``cancelled``), and with it
    the making room a runner may be doing for it. ``only``: the request makes no call after it, so the runner is not
    held for one (its keep-alive, and its eviction, count from now)."""
    cancelled = threading.Event()
    work = run_in_threadpool(lambda: scheduler.load(model, wait=True, timeout=None, cancelled=cancelled))
    runner = await while_connected(request, work, cancelled.set)
    if only:
        runner.release_claim()


async def log_refusal(request, status: int, message: str) -> None:
    """One log line for a request answered with an error: which API, the model it named (when its body says),
    its id, the status and why, so an operator sees why a client failed (a 5xx is a warning)."""
    path = request.url.path
    api = next((name for prefix, name in APIS if path.startswith(prefix)), "HTTP")
    model = ""
    try:
        body = json.loads(await request.body() or b"{}")
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            model = f", model {body['model'][:100]!r}"
    except (ValueError, RuntimeError, RecursionError):  # not JSON, or the body was streamed away
        pass
    level = logging.WARNING if status >= 500 else logging.INFO
    log.log(
        level,
        "%s %s %s (%s API%s, request %s): %d %s",
        "refused" if status < 500 else "failed",
        request.method,
        path,
        api,
        model,
        REQUEST_ID.get() or "-",
        status,
        message,
    )


def finite(value):
    """A number field's value, if a float can hold it: an integer too big for a float (``1e400`` written out) and
    NaN or infinity are refused (a 400 naming the field), never left to overflow later."""
    try:
        as_float = float(value)
    except OverflowError:
        raise ValueError("must be a number a float can hold") from None
    if not math.isfinite(as_float):
        raise ValueError("must be a finite number")
    return value


Number = Annotated[StrictInt | StrictFloat, AfterValidator(finite)]


def unfit(value, path: str = "") -> str | None:
    """What makes the JSON body unfit to serve, naming where, or None: a string with a lone surrogate
    (``"\ud800"``, which JSON allows and UTF-8 cannot carry), or NaN or Infinity (which Python's JSON reader takes
    and no JSON writer may write back). Walked without recursion: a body nested thousands deep is fine."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not is_unicode(item):
                return f"{where or 'body'}: {NOT_UNICODE}"
        elif isinstance(item, float):
            if not math.isfinite(item):
                return f"{where or 'body'}: NaN and Infinity are not JSON numbers"
        elif isinstance(item, dict):
            for key, inner in item.items():
                if isinstance(key, str) and not is_unicode(key):
                    return f"{where or 'body'}: {NOT_UNICODE}"
                stack.append((inner, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):
            stack.extend((inner, f"{where}.{index}" if where else str(index)) for index, inner in enumerate(item))
    return None


class Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def fit_to_serve(cls, data):
        problem = unfit(data)
        if problem is not None:
            raise ValueError(problem)
        return data


def refuse_not_honoured(extra: dict | None, table: dict, where: str = "") -> None:
    """400 for the first field of ``table`` (field -> whether a value asks for something not served) that
    ``extra`` (a request's unknown fields) uses: such a field is refused, never ignored. Every HTTP API's."""
    for key, value in (extra or {}).items():
        uses = table.get(key)
        if uses is not None and uses(value):
            raise ServiceError(
                Code.INVALID_ARGUMENT,
                f"{where}{key}: not supported by this server yet; leave it out (it would otherwise be ignored, "
                "and the answer would not be what it asks for)",
                f"{where}{key}",
            )


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")  # what a model's sampling defaults may fill


def left_out(**values) -> list[str]:
    """The sampling fields a client left out (None), for ``fields["defaulted"]``: the model's sampling defaults
    fill them where its config has some (``supervisor.generation``), the API's defaults otherwise."""
    return [name for name, value in values.items() if value is None]


def build_request(model: str, fields: dict, messages=(), ignore_eos: bool = False) -> supervisor_pb2.GenerateRequest:
    """The internal request every HTTP API builds (OpenAI's, Anthropic's), once ``check_fields`` has found every
    field in range (so each fits its message field). ``messages``: (role, content, name, tool_call_id,
    tool_calls) tuples. ``fields["defaulted"]``: the sampling fields the client left out (``left_out``)."""
    fields = dict(fields)
    defaulted = [name for name in fields.pop("defaulted", ()) if name in SAMPLING_FIELDS]
    check_fields(**fields, messages=messages)
    proto = supervisor_pb2.GenerateRequest(
        model=model, ignore_eos=ignore_eos, request_id=REQUEST_ID.get() or f"http-{secrets.token_hex(6)}"
    )
    for key, value in fields.items():
        if value is None:
            continue
        if isinstance(value, list):
            getattr(proto, key).extend(value)
        elif isinstance(value, dict):
            getattr(proto, key).update(value)
        else:
            setattr(proto, key, value)
    proto.defaulted.extend(defaulted)
    for role, content, name, call_id, calls, *more in messages:  # more: [reasoning[, images]]
        message = proto.messages.add(role=role, content=content, name=name, tool_call_id=call_id)
        message.reasoning = more[0] if more else ""
        message.images.extend(more[1] if len(more) > 1 else ())
        for call in calls:
            message.tool_calls.add(id=call[0], name=call[1], arguments=call[2])
    return proto


def speculation(stats: runner_pb2.GenerationStats) -> dict:
    return {
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": round(stats.acceptance_rate, 4),
        "rounds": stats.rounds,
        "tokens_per_second": round(stats.tokens_per_second, 2),
        "time_to_first_token_s": round(stats.time_to_first_token_s, 4),
        "drafter": stats.drafter,
        "forced": stats.forced,
    }


def chat_logprobs(entries) -> list[dict]:
    """The runner's logprob entries as OpenAI's chat (and Responses) give them: each token with its bytes and
    its alternatives."""
    return [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": list(e.token.encode("utf-8")),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))} for t in e.top
            ],
        }
        for e in entries
    ]


def tool_calls(deltas) -> list[dict]:
    """The answer's calls, put together from their deltas."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        if delta.id:
            call["id"], call["function"]["name"] = delta.id, delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[index] for index in sorted(calls)]


class EventStream(StreamingResponse):
    """Server-sent events (or, with its media type, NDJSON lines) of one generation. However the response ends
    (streamed to the end, client gone, or never started), the generation is cancelled, which stops its runner
    call, and its chunks (an async generator, ``aiter(generation)``) are closed.

    Starlette stops a stream whose client went away by cancelling it, and it neither closes ``events`` nor
    ``chunks``; left to the garbage collector, they would hold the runner call until a collection."""

    def __init__(self, events, generation, chunks, media_type: str = "text/event-stream"):
        super().__init__(
            events, media_type=media_type, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.generation, self.chunks = generation, chunks

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()  # a no-op once finished
            await self.events_closed()

    async def events_closed(self) -> None:
        for stream in (self.body_iterator, self.chunks):
            try:
                await stream.aclose()
            except RuntimeError:  # still running in a task of its adapter's, which closes it (anthropic_api)
                pass
