"""OpenAI's Responses API over the supervisor (the newer path of OpenAI's SDKs and agent frameworks).

    POST   /v1/responses        input (a string or items) -> output items (a message, function calls)
    GET    /v1/responses/{id}   a stored response
    DELETE /v1/responses/{id}

A thin adapter over the same internal request and generate path as OpenAI's chat: ``instructions`` are the
system message; input items (messages, ``function_call`` and ``function_call_output``) become the
conversation, tool calls and tool results; function ``tools``, ``tool_choice`` and ``parallel_tool_calls``
take issue #21's tool path; ``text.format`` (``json_schema``, ``json_object``) is the grammar. Streaming
sends the Responses event types (response.created, output_item.added, content_part.added,
output_text.delta, function_call_arguments.delta, their ``done`` events, response.completed or
response.incomplete), each with its sequence number.

``previous_response_id`` continues a stored conversation: a response is stored unless ``store: false``, in
a bounded store (``ResponseStore``: the ``MAX_STORED`` most recent, in memory; a supervisor restart forgets
them, and an id it no longer holds is a 404). As OpenAI's, a previous response's ``instructions`` are not
carried over. Errors have OpenAI's shape. Fields asking for what this server cannot do (hosted tools,
reasoning effort, background mode, truncation) are refused with a 400 naming them.
"""

from __future__ import annotations

import collections
import json
import secrets
import threading
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import ConfigDict, StrictBool, StrictInt, StrictStr

from common import images
from common.requests import FinishReason
from common.status import Code, ServiceError

from .http_common import (
    EventStream,
    Number,
    Schema,
    build_request,
    chat_logprobs,
    left_out,
    log_refusal,
    refuse_not_honoured,
    speculation,
    tool_calls,
)
from .http_errors import openai_error

MAX_STORED = 1024  # responses kept for previous_response_id and GET
MAX_TOKENS_UNSET = 2**31 - 1
NOT_HONOURED = {
    "background": lambda v: bool(v),
    "conversation": lambda v: v is not None,
    "prompt": lambda v: v is not None,
    "truncation": lambda v: v not in (None, "disabled"),
    "max_tool_calls": lambda v: v is not None,
    # reasoning.effort switches a model that thinks (common.reasoning); its reasoning comes whole (a reasoning
    # item's content), never summarised: "auto" leaves that to the server, a summary asked for is refused.
    "reasoning": lambda v: isinstance(v, dict) and v.get("summary") not in (None, "none", "auto"),
}
# What ``include`` may ask for: the answer's logprobs (served), and reasoning's encrypted content (there is no
# reasoning to include). The others are outputs of hosted tools, which are refused.
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")


def bad(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message, param)


class ResponseStore:
    """The most recent responses (their bodies, and each one's conversation for a continuation), bounded."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, tuple[dict, list]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, body: dict, conversation: list) -> None:
        with self._lock:
            self._items[body["id"]] = (body, conversation)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list]:
        with self._lock:
            found = self._items.get(response_id)
        if found is None:
            raise ServiceError(Code.NOT_FOUND, f"no stored response {response_id!r} (not stored, deleted or forgotten)")
        return found

    def delete(self, response_id: str) -> None:
        with self._lock:
            if self._items.pop(response_id, None) is None:
                raise ServiceError(Code.NOT_FOUND, f"no stored response {response_id!r}")


# -- the request -----------------------------------------------------------------------------------------------


class TextFormat(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr
    name: StrictStr | None = None
    schema_: dict[str, Any] | None = None

    def __init__(self, **data):
        if "schema" in data:
            data["schema_"] = data.pop("schema")
        super().__init__(**data)


class ResponsesRequest(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr
    input: StrictStr | list[dict[str, Any]] = ""
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None  # OpenAI's: at most 16 keys, strings as values
    user: StrictStr | None = None
    include: list[StrictStr] | None = None
    top_logprobs: StrictInt | None = None
    reasoning_budget: StrictInt | None = None  # this server's: the most reasoning tokens (its end forced)

    @property
    def logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    def conversation(self, earlier: list) -> list[tuple]:
        """The internal conversation: the previous response's, then this input (the instructions apart)."""
        out = list(earlier)
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        names = {call[0]: call[1] for message in out for call in message[4]}
        thought = ""  # an earlier reasoning item's text: it goes with the assistant's turn after it
        for index, item in enumerate(items):
            kind = item.get("type", "message")
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise bad(f"input[{index}].role: {role!r} is not user, assistant, system or developer", "input")
                role = "system" if role == "developer" else role
                text, pictures = _text(item.get("content"), index), _images(item.get("content"), index)
                out.append((role, text, "", "", (), thought if role == "assistant" else "", pictures))
                thought = "" if role == "assistant" else thought
            elif kind == "function_call":
                call_id, name = item.get("call_id"), item.get("name")
                if (
                    not isinstance(call_id, str)
                    or not isinstance(name, str)
                    or not isinstance(item.get("arguments"), str)
                ):
                    raise bad(f"input[{index}]: a function_call needs call_id, name and arguments", "input")
                names[call_id] = name
                call = (call_id, name, item["arguments"])
                if out and out[-1][0] == "assistant" and out[-1][4] and not out[-1][1]:  # calls of one turn
                    out[-1] = out[-1][:4] + (out[-1][4] + (call,),)
                else:
                    out.append(("assistant", "", "", "", (call,), thought))
                    thought = ""
            elif kind == "function_call_output":
                call_id, output = item.get("call_id"), item.get("output")
                if not isinstance(call_id, str) or not isinstance(output, str):
                    raise bad(f"input[{index}]: a function_call_output needs call_id and output (text)", "input")
                out.append(("tool", output, names.get(call_id, ""), call_id, ()))
            elif kind == "reasoning":
                parts = item.get("content") or []
                thought += "".join(
                    p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            else:
                raise bad(f"input[{index}]: items of type {kind!r} are not supported", "input")
        return out

    def tool_fields(self) -> dict:
        tools = []
        for index, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise bad(f"tools[{index}]: only function tools are supported, not {tool.get('type')!r}", "tools")
            function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {"type": "object"}}
            if tool.get("description"):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        choice, name = self.tool_choice, ""
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad(
                    'tool_choice: must be "auto", "none", "required" or {"type": "function", "name": ...}',
                    "tool_choice",
                )
            choice, name = "function", choice["name"]
        elif choice == "function":
            raise bad("tool_choice: 'function' is not one of auto, none, required", "tool_choice")
        return {
            "tools": json.dumps(tools, ensure_ascii=False) if tools else "",
            "tool_choice": choice or "",
            "tool_name": name,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def grammar(self) -> str:
        if (self.text or {}).get("verbosity") not in (None, "medium"):
            raise bad("text.verbosity: not supported by this server (no model here is trained for it)", "text")
        form = (self.text or {}).get("format")
        if form is not None and not isinstance(form, dict):
            raise bad('text.format: must be an object such as {"type": "json_schema", "schema": {...}}', "text")
        if form is None or form.get("type") == "text":
            return ""
        if form.get("type") == "json_object":
            return json.dumps({"json_object": True})
        if form.get("type") == "json_schema" and isinstance(form.get("schema"), dict):
            return json.dumps({"json_schema": form["schema"]})
        raise bad("text.format: must be text, json_object or json_schema with a schema", "text")

    def effort(self) -> str:
        """``reasoning.effort`` (common.reasoning.EFFORTS; checked by check_fields), "" when not given."""
        reasoning = (self.model_extra or {}).get("reasoning")
        effort = reasoning.get("effort") if isinstance(reasoning, dict) else None
        if effort is not None and not isinstance(effort, str):
            raise bad("reasoning.effort: must be a string", "reasoning")
        return effort or ""

    def to_proto(self, earlier: list) -> tuple[Any, list]:
        refuse_not_honoured(self.model_extra, NOT_HONOURED)
        for index, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise bad(f"include[{index}]: {value!r} is not served here (only {', '.join(INCLUDABLE)})", "include")
        if len(self.metadata or {}) > 16:
            raise bad("metadata: at most 16 keys", "metadata")
        if self.top_logprobs and not self.logprobs:
            raise bad('top_logprobs: needs include ["message.output_text.logprobs"]', "top_logprobs")
        conversation = self.conversation(earlier)
        messages = ([("system", self.instructions, "", "", ())] if self.instructions else []) + conversation
        fields = {
            "max_tokens": MAX_TOKENS_UNSET if self.max_output_tokens is None else self.max_output_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "grammar": self.grammar(),
            "defaulted": left_out(temperature=self.temperature, top_p=self.top_p),
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs or 0,
            "reasoning_effort": self.effort(),
            "reasoning_budget": self.reasoning_budget,
            **self.tool_fields(),
        }
        return build_request(self.model, fields, messages), conversation


def _text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"input[{index}].content: must be text or a list of text parts", "input")
    parts = []
    for number, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "input_image":
            continue  # _images
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad(f"input[{index}].content: parts of type {kind!r} are not supported (text only)", "input")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad(f"input[{index}].content[{number}].text: must be a string", "input")
        parts.append(text)
    return "".join(parts)


def _images(content, index: int) -> tuple[bytes, ...]:
    """A message's ``input_image`` parts' images (``image_url`` data: URLs; ``file_id``s are not served)."""
    out = []
    for number, part in enumerate(content if isinstance(content, list) else ()):
        if isinstance(part, dict) and part.get("type") == "input_image":
            where = f"input[{index}].content[{number}]"
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{where}: an input_image needs an image_url (file ids are not served)", "input")
            out.append(images.from_url(url, where, "input"))
    return tuple(out)


# -- the response ----------------------------------------------------------------------------------------------


class Answer:
    """One response: its id, its items' ids, and its body at any point (in progress, then final)."""

    def __init__(self, body: ResponsesRequest):
        self.request = body
        self.id = "resp_" + secrets.token_hex(12)
        self.created = int(time.time())
        self.message_id = "msg_" + secrets.token_hex(12)
        self.reasoning_id = "rs_" + secrets.token_hex(12)
        self.reasoning = ""  # a model that thinks apart: its reasoning, a reasoning item before the message
        self.text = ""
        self.calls: list[dict] = []  # {"id", "call_id", "name", "arguments"}
        self.logprobs: list[dict] = []  # the text's tokens' logprobs (include message.output_text.logprobs)
        self.sequence = 0
        self.incomplete = False  # cut by max_output_tokens: the last item is cut too

    def message_item(self, status: str) -> dict:
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": self.logprobs}
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": [part]}

    def call_item(self, call: dict, status: str) -> dict:
        return {"type": "function_call", "status": status, **call}

    def reasoning_item(self, status: str) -> dict:
        part = {"type": "reasoning_text", "text": self.reasoning}
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [], "content": [part]}

    def status_of(self, item_index: int) -> str:
        """An output item's status once the answer ended: the last one of a response cut short is incomplete (a
        function call with half its arguments, as OpenAI marks it), the others completed."""
        last = bool(self.reasoning) + bool(self.text) + len(self.calls) - 1
        return "incomplete" if self.incomplete and item_index == last else "completed"

    def output(self) -> list[dict]:
        items = [self.reasoning_item(self.status_of(0))] if self.reasoning else []
        if self.text:
            items.append(self.message_item(self.status_of(len(items))))
        first = len(items)
        return items + [self.call_item(call, self.status_of(first + i)) for i, call in enumerate(self.calls)]

    def finish(self, last) -> None:
        self.incomplete = last.finish_reason == FinishReason.LENGTH

    def body(self, last=None) -> dict:
        r = self.request
        status = "in_progress"
        incomplete = None
        usage = None
        if last is not None:
            self.finish(last)
            status = "incomplete" if self.incomplete else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            s = last.stats
            usage = {
                "input_tokens": s.prompt_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens},
                "output_tokens": s.generated_tokens,
                "output_tokens_details": {"reasoning_tokens": s.reasoning_tokens},
                "total_tokens": s.prompt_tokens + s.generated_tokens,
            }
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": r.model,
            "output": self.output() if last is not None else [],
            "error": None,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "previous_response_id": r.previous_response_id,
            "store": r.store,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "text": r.text or {"format": {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": r.tools or [],
            "metadata": r.metadata or {},
            "user": r.user,
            "usage": usage,
        }
        if last is not None:
            out["x_mlxserve"] = speculation(last.stats)
        return out

    def take_whole(self, chunks: list) -> None:
        self.reasoning = "".join(c.reasoning for c in chunks)
        self.text = "".join(c.text for c in chunks)
        if self.request.logprobs:
            self.logprobs = chat_logprobs([e for c in chunks for e in c.logprobs])
        for call in tool_calls([d for c in chunks for d in c.tool_calls]):
            self.calls.append(self._call(call["id"], call["function"]["name"], call["function"]["arguments"]))

    @staticmethod
    def _call(call_id: str, name: str, arguments: str) -> dict:
        return {"id": "fc_" + secrets.token_hex(12), "call_id": call_id, "name": name, "arguments": arguments}

    def conversation_after(self, conversation: list) -> list:
        """The conversation a continuation starts from: this one's input, then its answer."""
        calls = tuple((c["call_id"], c["name"], c["arguments"]) for c in self.calls)
        return conversation + [("assistant", self.text, "", "", calls, self.reasoning)]

    # -- streaming events --

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def register(app: FastAPI, supervisor, authorized, until_done) -> None:
    """Add the Responses API's routes to the HTTP API's app."""
    store = ResponseStore()

    @app.get("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def get(response_id: str):
        return store.get(response_id)[0]

    @app.post("/v1/responses/{response_id}/cancel", dependencies=[Depends(authorized)])
    async def cancel(response_id: str):
        store.get(response_id)  # 404 for an id it does not hold
        raise bad("Only responses created with background=true can be cancelled (background mode is not served here)")

    @app.delete("/v1/responses/{response_id}", dependencies=[Depends(authorized)])
    async def delete(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def create(body: ResponsesRequest, request: Request):
        earlier = store.get(body.previous_response_id)[1] if body.previous_response_id else []
        proto, conversation = body.to_proto(earlier)
        generation = supervisor.generate(proto, timeout=None)
        answer = Answer(body)
        if not body.stream:
            chunks = await until_done(request, generation, generation.collect)
            answer.take_whole(chunks)
            final = answer.body(chunks[-1])
            if body.store:
                store.put(final, answer.conversation_after(conversation))
            return final
        chunks = aiter(generation)
        first = await until_done(request, generation, lambda: anext(chunks, None))

        async def events():
            yield answer.event("response.created", response=answer.body())
            yield answer.event("response.in_progress", response=answer.body())
            chunk, index, message_open, call, reasoning_open = first, 0, False, None, False

            def close_reasoning():
                item = answer.reasoning_item(answer.status_of(index))
                return [
                    answer.event(
                        "response.reasoning_text.done",
                        item_id=answer.reasoning_id,
                        output_index=index,
                        content_index=0,
                        text=answer.reasoning,
                    ),
                    answer.event("response.output_item.done", output_index=index, item=item),
                ]

            def close_message():
                item = answer.message_item(answer.status_of(index))
                part = item["content"][0]
                return [
                    answer.event(
                        "response.output_text.done",
                        item_id=answer.message_id,
                        output_index=index,
                        content_index=0,
                        text=answer.text,
                        logprobs=answer.logprobs,
                    ),
                    answer.event(
                        "response.content_part.done",
                        item_id=answer.message_id,
                        output_index=index,
                        content_index=0,
                        part=part,
                    ),
                    answer.event("response.output_item.done", output_index=index, item=item),
                ]

            def close_call(at: int):
                return [
                    answer.event(
                        "response.function_call_arguments.done",
                        item_id=call["id"],
                        output_index=at,
                        arguments=call["arguments"],
                    ),
                    answer.event(
                        "response.output_item.done", output_index=at, item=answer.call_item(call, answer.status_of(at))
                    ),
                ]

            try:
                while chunk is not None:
                    if chunk.reasoning:  # a model that thinks apart: a reasoning item first
                        if not reasoning_open:
                            reasoning_open = True
                            item = answer.reasoning_item("in_progress")
                            yield answer.event("response.output_item.added", output_index=index, item=item)
                        answer.reasoning += chunk.reasoning
                        yield answer.event(
                            "response.reasoning_text.delta",
                            item_id=answer.reasoning_id,
                            output_index=index,
                            content_index=0,
                            delta=chunk.reasoning,
                        )
                    if reasoning_open and (chunk.text or chunk.tool_calls or chunk.finish_reason):
                        if chunk.finish_reason and not (chunk.text or chunk.tool_calls):
                            answer.finish(chunk)
                        for event in close_reasoning():
                            yield event
                        reasoning_open, index = False, index + 1
                    if chunk.text:
                        if not message_open:
                            message_open = True
                            item = answer.message_item("in_progress")
                            item["content"] = []
                            yield answer.event("response.output_item.added", output_index=index, item=item)
                            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                            yield answer.event(
                                "response.content_part.added",
                                item_id=answer.message_id,
                                output_index=index,
                                content_index=0,
                                part=part,
                            )
                        answer.text += chunk.text
                        logprobs = chat_logprobs(chunk.logprobs) if body.logprobs else []
                        answer.logprobs += logprobs
                        yield answer.event(
                            "response.output_text.delta",
                            item_id=answer.message_id,
                            output_index=index,
                            content_index=0,
                            delta=chunk.text,
                            logprobs=logprobs,
                        )
                    for piece in chunk.tool_calls:
                        if piece.id:
                            if message_open:
                                for event in close_message():
                                    yield event
                                message_open, index = False, index + 1
                            elif call is not None:
                                for event in close_call(index):
                                    yield event
                                index += 1
                            call = answer._call(piece.id, piece.name, "")
                            answer.calls.append(call)
                            yield answer.event(
                                "response.output_item.added",
                                output_index=index,
                                item=answer.call_item(call, "in_progress"),
                            )
                        if piece.arguments:
                            call["arguments"] += piece.arguments
                            yield answer.event(
                                "response.function_call_arguments.delta",
                                item_id=call["id"],
                                output_index=index,
                                delta=piece.arguments,
                            )
                    if chunk.finish_reason:
                        answer.finish(chunk)
                        for event in close_message() if message_open else close_call(index) if call is not None else []:
                            yield event
                        final = answer.body(chunk)
                        if body.store:
                            store.put(final, answer.conversation_after(conversation))
                        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
                        yield answer.event(kind, response=final)
                    chunk = await anext(chunks, None)
            except ServiceError as error:
                status, shaped = openai_error(error, "input")
                await log_refusal(request, status, f"(in the stream) {error.message}")
                yield answer.event("error", **shaped["error"])

        return EventStream(events(), generation, chunks)
