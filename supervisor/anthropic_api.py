"""Anthropic's Messages API over the supervisor (so the ``anthropic`` SDK and Claude Code work against it).

    POST /v1/messages               a conversation of content blocks -> an answer of content blocks
    POST /v1/messages/count_tokens  the prompt's tokens, exact (the model's tokenizer, chat template, tools)

A thin adapter: the request becomes the same internal request as OpenAI's chat
(``supervisor_pb2.GenerateRequest``: system, messages, tools as OpenAI's
function tools, tool results as tool messages) and takes the same generate
path; the runner's chunks become Anthropic's content blocks (``text``,
``tool_use``) or its stream of events (message_start, content_block_start,
ping, content_block_delta with ``text_delta`` and ``input_json_delta``,
content_block_stop, message_delta, message_stop, and ``error``). A stream
whose first chunk takes longer than ``FIRST_CHUNK_WAIT`` (a long prompt
prefilling) starts anyway and sends a ping every ``PING_EVERY`` seconds until
it comes; an error before the stream started is an HTTP status, after it an
``error`` event. Errors have Anthropic's shape, ``{"type": "error", "error":
{"type", "message"}}``; the bearer token may come as ``x-api-key``.

Usage follows Anthropic's sense: ``input_tokens`` are the prompt tokens
prefilled, ``cache_read_input_tokens`` those the prompt cache gave. Fields this
server cannot honour are refused (400), never ignored: server tools, documents,
image URLs. Thinking switches a model that thinks; image blocks go to a model
that sees. ``output_config.format`` (a JSON schema) is
structured output, as ``response_format`` is OpenAI's; ``temperature``,
``top_p`` and ``top_k`` are taken from clients that still send them (Anthropic's
own SDK no longer does); hints (``service_tier``, ``speed``, ``cache_control``,
``output_config.effort``) are accepted and change nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from common import images
from common.requests import FinishReason
from common.status import Code, ServiceError

from .http_common import (
    EventStream,
    Number,
    Schema,
    build_request,
    left_out,
    log_refusal,
    refuse_not_honoured,
    speculation,
    tool_calls,
)
from .http_errors import http_status, in_api_words
from .protocol import supervisor_pb2

FIRST_CHUNK_WAIT = 1.0  # seconds a stream waits for its first chunk before it starts (then errors are events)
PING_EVERY = 5.0  # seconds between pings while the first chunk is coming
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Fields that ask for what this server does not do: refused, never ignored (a value that asks for nothing passes).
# thinking: "enabled" (with its budget_tokens, enforced) and "disabled" switch a model that thinks (common.reasoning;
# "enabled" is refused for a model that does not); "adaptive" lets the model decide, so a model that does not
# reason serves it without thinking (Claude Code sends it for every model); context_management's clear_thinking
# edits ask to drop earlier thinking, which the templates here drop anyway. Other edits (clearing old tool
# results) would change the prompt: refused.
NOT_HONOURED = {
    "thinking": lambda v: isinstance(v, dict) and v.get("type") not in (None, "disabled", "adaptive", "enabled"),
    "context_management": lambda v: (
        isinstance(v, dict)
        and any(
            not (isinstance(edit, dict) and str(edit.get("type", "")).startswith("clear_thinking"))
            for edit in v.get("edits") or ()
        )
    ),
    "mcp_servers": lambda v: bool(v),
    "container": lambda v: v is not None,
}


def anthropic_error(error: ServiceError) -> tuple[int, dict]:
    """HTTP status and body in Anthropic's error shape; a full queue is Anthropic's 529 overloaded_error, which
    its clients retry after a while."""
    error = in_api_words(error, {"think": ("thinking", "thinking"), "reasoning_budget": ("thinking", "thinking")})
    status = 529 if error.code == Code.RESOURCE_EXHAUSTED else http_status(error.code)
    kind = ERROR_TYPES.get(status, "api_error")
    message = error.message
    if error.exceeded is not None:  # Anthropic's words, which its clients look for before they compact
        exceeded = error.exceeded
        message = f"prompt is too long: {exceeded.amount} > {exceeded.context} maximum"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def bad(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message, param)


# -- request schemas ----------------------------------------------------------------------------------------


class Block(Schema):
    model_config = ConfigDict(extra="allow", strict=True)  # cache_control and other hints are ignored
    type: StrictStr
    text: StrictStr | None = None
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: dict[str, Any] | None = None
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[dict[str, Any]] | None = None
    is_error: StrictBool | None = None


class Message(Schema):
    role: StrictStr
    content: StrictStr | list[Block]


class Tool(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr | None = None  # "custom" or absent; server tools (web search, ...) are not served
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None  # required for a custom tool (checked with its type)


class ToolChoice(Schema):
    type: StrictStr
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool = False


class CountTokensRequest(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr
    messages: list[Message] = Field(min_length=1)
    system: StrictStr | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    def conversation(self) -> list[tuple]:
        """(role, content, name, tool_call_id, tool_calls) tuples, as the internal request takes them."""
        out: list[tuple] = []
        system = self.system if isinstance(self.system, str) else _texts(self.system or [], "system")
        if system:
            out.append(("system", system, "", "", ()))
        names: dict[str, str] = {}  # tool_use id -> the tool's name, for the results
        for i, message in enumerate(self.messages):
            if message.role not in ("user", "assistant", "system"):
                raise bad(f"messages.{i}.role: must be user, assistant or system, not {message.role!r}", "messages")
            if message.role == "system":  # a mid-conversation system message (Claude Code's), where it stands
                text = message.content if isinstance(message.content, str) else _texts(message.content, f"messages.{i}")
                out.append(("system", text, "", "", ()))
                continue
            if isinstance(message.content, str):
                out.append((message.role, message.content, "", "", ()))
                continue
            texts, calls, thoughts, pictures = [], [], [], []
            for j, block in enumerate(message.content):
                where = f"messages.{i}.content.{j}"
                if block.type == "text":
                    texts.append(block.text or "")
                elif block.type == "image" and message.role == "user":
                    pictures.append(_image((block.model_extra or {}).get("source"), where))
                elif block.type == "tool_use" and message.role == "assistant":
                    if not block.id or not block.name:
                        raise bad(f"{where}: a tool_use block needs an id and a name", "messages")
                    names[block.id] = block.name
                    calls.append((block.id, block.name, json.dumps(block.input or {}, ensure_ascii=False)))
                elif block.type == "tool_result" and message.role == "user":
                    shown: tuple = ()  # a tool's images (a screenshot): with its result
                    if isinstance(block.content, str):
                        result = block.content
                    else:
                        parts = block.content or []
                        shown = tuple(
                            _image(p.get("source"), f"{where}.content.{k}")
                            for k, p in enumerate(parts)
                            if isinstance(p, dict) and p.get("type") == "image"
                        )
                        result = _texts(
                            [p for p in parts if not (isinstance(p, dict) and p.get("type") == "image")], where
                        )
                    if block.is_error:
                        result = f"Error: {result}"
                    call_id = block.tool_use_id or ""
                    out.append(("tool", result, names.get(call_id, ""), call_id, (), "", shown))
                elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
                    # An earlier turn's reasoning: its template decides whether it goes back (most drop it).
                    thought = (block.model_extra or {}).get("thinking")
                    if isinstance(thought, str):
                        thoughts.append(thought)
                else:
                    raise bad(
                        f"{where}: {block.type!r} blocks are not supported in a {message.role} message", "messages"
                    )
            if texts or calls or pictures:
                out.append((message.role, "".join(texts), "", "", tuple(calls), "\n\n".join(thoughts), tuple(pictures)))
        return out

    def thinking_fields(self) -> dict:
        """``thinking`` as the runner's switches: "enabled" with its budget_tokens (enforced), "disabled", or
        "adaptive" (the model's own default)."""
        thinking = (self.model_extra or {}).get("thinking")
        if not isinstance(thinking, dict) or thinking.get("type") in (None, "adaptive"):
            return {}
        if thinking["type"] == "disabled":
            return {"think": "off"}
        budget = thinking.get("budget_tokens")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise bad("thinking.budget_tokens: must be an integer >= 0", "thinking")
        return {"think": "on", "reasoning_budget": budget}

    def tool_fields(self) -> dict:
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise bad(f"tools.{index}: server tools ({tool.type}) are not supported", "tools")
            if tool.input_schema is None:
                raise bad(f"tools.{index}.input_schema: Field required", "tools")
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        choice, name, parallel = "", "", None
        if self.tool_choice is not None:
            kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
            if self.tool_choice.type not in kinds:
                raise bad(
                    f"tool_choice.type: {self.tool_choice.type!r} is not one of auto, any, tool, none", "tool_choice"
                )
            choice, name = kinds[self.tool_choice.type], self.tool_choice.name or ""
            parallel = False if self.tool_choice.disable_parallel_tool_use else None
        return {
            "tools": json.dumps(tools, ensure_ascii=False) if tools else "",
            "tool_choice": choice,
            "tool_name": name,
            "parallel_tool_calls": parallel,
        }

    def to_proto(self, **fields) -> supervisor_pb2.GenerateRequest:
        refuse_not_honoured(self.model_extra, NOT_HONOURED)
        return build_request(
            self.model, {**fields, **self.tool_fields(), **self.thinking_fields()}, self.conversation()
        )


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # its format: structured output (its effort: no reasoning here)

    def grammar(self) -> str:
        """``output_config.format`` (a JSON schema) as the runner's grammar; "" for free text."""
        output = (self.output_config or {}).get("format")
        if output is None:
            return ""
        schema = output.get("schema") if isinstance(output, dict) else None
        if not isinstance(schema, dict) or output.get("type") != "json_schema":
            raise bad('output_config.format: must be {"type": "json_schema", "schema": {...}}', "output_config")
        return json.dumps({"json_schema": schema})

    def generation(self) -> supervisor_pb2.GenerateRequest:
        if self.temperature is not None and not 0 <= self.temperature <= 1:
            raise bad("temperature: must lie in [0, 1]", "temperature")
        return self.to_proto(
            grammar=self.grammar(),
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,  # Anthropic's default
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=list(self.stop_sequences or ()),
            defaulted=left_out(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
        )


def _image(source, where: str) -> bytes:
    """An ``image`` block's bytes: its ``source`` as base64 (a url source is not fetched: common.images)."""
    if not isinstance(source, dict):
        raise bad(f"{where}.source: an image block needs a source", "messages")
    if source.get("type") == "url":
        return images.from_url(str(source.get("url", "")), where)
    if source.get("type") != "base64" or not isinstance(source.get("data"), str):
        raise bad(f'{where}.source: must be {{"type": "base64", "media_type": ..., "data": ...}}', "messages")
    return images.from_base64(source["data"], where)


def _texts(blocks, where: str) -> str:
    parts = []
    for block in blocks:
        kind = block.type if isinstance(block, Block) else block.get("type")
        text = block.text if isinstance(block, Block) else block.get("text")
        if kind != "text" or not isinstance(text, str):
            raise bad(f"{where}: only text blocks are supported here, not {kind!r}", "messages")
        parts.append(text)
    return "".join(parts)


# -- answers ----------------------------------------------------------------------------------------------


def stop_reason(chunk) -> str:
    if chunk.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use"
    if chunk.finish_reason == FinishReason.LENGTH:
        return "max_tokens"
    return "stop_sequence" if chunk.stop_sequence else "end_turn"


def usage(stats) -> dict:
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "output_tokens": stats.generated_tokens,
        "cache_read_input_tokens": stats.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message_body(model: str, message_id: str, content: list, last=None) -> dict:
    body = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    if last is not None:
        body.update(stop_reason=stop_reason(last), stop_sequence=last.stop_sequence or None, usage=usage(last.stats))
        body["x_mlxserve"] = speculation(last.stats)
    return body


def signature(thinking: str) -> str:
    """A thinking block's ``signature``, which Anthropic's clients keep and send back: here only a digest of its
    text (an earlier turn's thinking is not laid out again, so nothing is checked against it)."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def whole(model: str, chunks: list) -> dict:
    text = "".join(c.text for c in chunks)
    reasoning = "".join(c.reasoning for c in chunks)
    content = [{"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}] if reasoning else []
    content += [{"type": "text", "text": text}] if text else []
    for call in tool_calls([d for c in chunks for d in c.tool_calls]):
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:  # cut short by max_tokens: what came, as text
            arguments = {"partial_json": call["function"]["arguments"]}
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    return message_body(model, "msg_" + secrets.token_hex(12), content, chunks[-1])


def sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class BlockStream:
    """Anthropic's events for one answer's chunks: one content block open at a time (text, then each call)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # "thinking", "text", or the id of the call whose block is open
        self.thinking = ""  # the thinking block's text, for its signature

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # its signature comes last, as Anthropic sends it
            delta = {"type": "signature_delta", "signature": signature(self.thinking)}
            events.append(
                sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            )
        self.open = None
        return events + [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, block: dict, key: str) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = key
        return events + [
            sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def chunk(self, chunk) -> list[str]:
        events = []
        if chunk.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            self.thinking += chunk.reasoning
            delta = {"type": "thinking_delta", "thinking": chunk.reasoning}
            events.append(
                sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            )
        if chunk.text:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            delta = {"type": "text_delta", "text": chunk.text}
            events.append(
                sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
            )
        for piece in chunk.tool_calls:
            if piece.id:
                events += self._start({"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}, piece.id)
            if piece.arguments:
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                events.append(
                    sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
                )
        if chunk.finish_reason:
            events += self._close()
            delta = {"stop_reason": stop_reason(chunk), "stop_sequence": chunk.stop_sequence or None}
            events.append(sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(chunk.stats)}))
            events.append(sse("message_stop", {"type": "message_stop"}))
        return events


# -- routes ---------------------------------------------------------------------------------------------------


def register(app: FastAPI, supervisor, authorized, until_done) -> None:
    """Add the Messages API's routes to the HTTP API's app (its auth and its cancel-on-disconnect wait)."""

    @app.post("/v1/messages/count_tokens", dependencies=[Depends(authorized)])
    async def count_tokens(body: CountTokensRequest):
        proto = body.to_proto(max_tokens=1)
        return {"input_tokens": await run_in_threadpool(supervisor.count_tokens, proto)}

    @app.post("/v1/messages", dependencies=[Depends(authorized)])
    async def messages(body: MessagesRequest, request: Request):
        generation = supervisor.generate(body.generation(), timeout=None)
        if not body.stream:
            return whole(body.model, await until_done(request, generation, generation.collect))
        return await stream(request, body.model, generation)

    async def stream(request: Request, model: str, generation):
        chunks = aiter(generation)
        first_chunk = asyncio.ensure_future(anext(chunks, None))
        try:
            # Within FIRST_CHUNK_WAIT, an error is still an HTTP status.
            await asyncio.wait_for(asyncio.shield(first_chunk), FIRST_CHUNK_WAIT)
        except TimeoutError:
            pass
        if first_chunk.done() and first_chunk.exception() is not None:
            raise first_chunk.exception()
        message_id = "msg_" + secrets.token_hex(12)

        async def events():
            start = message_body(model, message_id, [])
            if first_chunk.done():
                start["usage"]["input_tokens"] = first_chunk.result().prompt_tokens
            yield sse("message_start", {"type": "message_start", "message": start})
            yield sse("ping", {"type": "ping"})
            blocks = BlockStream()
            try:
                while not first_chunk.done():  # a long prompt prefilling
                    done, _ = await asyncio.wait({first_chunk}, timeout=PING_EVERY)
                    if not done:
                        yield sse("ping", {"type": "ping"})
                chunk = first_chunk.result()
                while chunk is not None:
                    for event in blocks.chunk(chunk):
                        yield event
                    chunk = await anext(chunks, None)
            except ServiceError as error:
                status, shaped = anthropic_error(error)
                await log_refusal(request, status, f"(in the stream) {error.message}")
                yield sse("error", shaped)
            finally:
                if not first_chunk.done():  # the client went away while the prompt prefilled
                    generation.cancel()
                    first_chunk.cancel()
                    await asyncio.wait({first_chunk})  # chunks not running when the stream closes them

        return EventStream(events(), generation, chunks)


def error_response(error: ServiceError) -> JSONResponse:
    status, body = anthropic_error(error)
    return JSONResponse(body, status_code=status)
