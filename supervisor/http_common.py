"""What every HTTP API adapter of the supervisor shares (OpenAI's, Anthropic's): the strict request schema base,
the one internal request they build, the speculation figures, tool calls put together from their deltas, and
the server-sent event stream that cancels its generation however it ends."""

from __future__ import annotations

import secrets

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictFloat, StrictInt, model_validator

from common.protocol import runner_pb2
from common.requests import NOT_UNICODE, check_fields, is_unicode
from common.status import Code, ServiceError

from .protocol import supervisor_pb2

Number = StrictInt | StrictFloat


def lone_surrogate(value, path: str = "") -> str | None:
    """Where a string of the JSON body holds a lone surrogate (``"\\ud800"``, which JSON allows and UTF-8 cannot
    carry), or None."""
    if isinstance(value, str):
        if not is_unicode(value):
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate(key, path) or lone_surrogate(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = lone_surrogate(item, f"{path}.{index}" if path else str(index))
            if found:
                return found
    return None


class Schema(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def unicode_only(cls, data):
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where}: {NOT_UNICODE}")
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


def build_request(model: str, fields: dict, messages=(), ignore_eos: bool = False) -> supervisor_pb2.GenerateRequest:
    """The internal request every HTTP API builds (OpenAI's, Anthropic's), once ``check_fields`` has found every
    field in range (so each fits its message field). ``messages``: (role, content, name, tool_call_id,
    tool_calls) tuples."""
    check_fields(**fields, messages=messages)
    proto = supervisor_pb2.GenerateRequest(
        model=model, ignore_eos=ignore_eos, request_id=f"http-{secrets.token_hex(6)}"
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
    for role, content, name, call_id, calls in messages:
        message = proto.messages.add(role=role, content=content, name=name, tool_call_id=call_id)
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
