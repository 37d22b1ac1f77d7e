"""The OpenAI-compatible HTTP API of the supervisor (FastAPI on uvicorn, pydantic request schemas).

    POST /v1/chat/completions   messages -> the model's chat template -> an answer
    POST /v1/completions        a raw prompt (text or token ids)
    GET  /v1/models, /v1/models/{id}

Streaming answers are server-sent events, ``data: {json}`` each, ending with
``data: [DONE]``. Every request takes the same internal path as the gRPC
Generate (``Supervisor.generate``), and every error the same mapping to a
status (``common.status``), here as an HTTP status with OpenAI's error shape:
``{"error": {"message", "type", "param", "code"}}``. Unknown request fields are
ignored, except OpenAI's that ask for something this server does not do yet
(``functions``, ``best_of``, ...: ``NOT_HONOURED``), which are a
400 naming the field. ``response_format`` and vLLM's ``guided_*`` become the
runner's ``grammar`` (``grammar_of``; runner.constraint). Chat's ``tools``,
``tool_choice`` and ``parallel_tool_calls``, and the history's ``tool_calls`` and
``tool_call_id``, go to the runner as they are (common.tool_calls lays them out,
constrains and parses); its tool-call deltas become ``message.tool_calls`` or
streamed ``delta.tool_calls``, as OpenAI's. Malformed or
wrong-typed fields are a 400 naming the field. The schemas check only types: whether a value is in range is decided by
``common.requests.check_fields``, the same judge and wording as the gRPC API's
and the runner's, called before the message is built (a value no message field
holds, or a string with a lone surrogate, is a 400 too, never a 5xx). A client that
disconnects cancels its generation, which stops within one round.

The speculation figures of an answer (drafted, accepted, tokens per second)
come under the extra key ``x_mlxserve``, which leaves OpenAI's schema valid.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from common import images
from common.errors import InvalidRequest
from common.protocol import runner_pb2
from common.requests import MAX_CHOICES, FinishReason
from common.settings import adapter_folders
from common.status import Code, ServiceError, status_of

from .generation import with_adapter
from .http_common import (
    EventStream,
    Number,
    RequestIds,
    Schema,
    build_request,
    chat_logprobs,
    left_out,
    log_refusal,
    refuse_not_honoured,
    speculation,
    tool_calls,
    while_connected,
)
from .http_errors import openai_error
from .protocol import supervisor_pb2

log = logging.getLogger("supervisor")

SEND_BUFFER = 128 * 1024  # bytes; the kernel doubles it
MAX_TOKENS_UNSET = 2**31 - 1  # the runner caps it at the room left in the context
FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "stop",
    FinishReason.TOOL_CALLS: "tool_calls",
}


# -- request schemas ----------------------------------------------------------------------------------


# OpenAI fields that change what the model must produce, which this server does not honour yet (or not on this
# endpoint: tools on /v1/completions): a request that uses one is refused (400 naming it), never answered as
# if it were absent. A value that asks for nothing (an empty list, a zero penalty, "text" output, tool_choice
# "none") is accepted.
NOT_HONOURED = {
    "tools": lambda v: bool(v),
    "tool_choice": lambda v: v not in (None, "none"),
    "functions": lambda v: bool(v),
    "function_call": lambda v: v not in (None, "none"),
    "best_of": lambda v: v not in (None, 1),
    "prediction": lambda v: v is not None,
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "web_search_options": lambda v: v is not None,
    "verbosity": lambda v: v not in (None, "medium"),  # GPT-5's answer-length switch: no model here is trained on it
}
# Hints, accepted and documented (docs/clients.md): store and metadata (nothing is stored for later listing),
# prompt_cache_key (the prompt cache finds a shared prefix by itself), safety_identifier, service_tier, user.


class ContentPart(Schema):
    type: StrictStr
    text: StrictStr | None = None
    image_url: dict[str, Any] | StrictStr | None = None  # {"url": "data:image/png;base64,..."} (images.from_url)


class FunctionCall(Schema):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text (checked by common.tool_calls.check_history)


class MessageToolCall(Schema):
    id: StrictStr = ""
    type: StrictStr = "function"
    function: FunctionCall


class ChatMessage(Schema):
    role: StrictStr  # common.requests.ROLES, and "developer" (a system message)
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    # An assistant's earlier reasoning (DeepSeek's and vLLM's name; OpenRouter's ``reasoning``): its template
    # decides whether it goes back into the prompt (most drop it).
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None

    def calls(self) -> tuple:
        for call in self.tool_calls or ():
            if call.type != "function":
                raise ServiceError(
                    Code.INVALID_ARGUMENT, f"messages: tool calls of type {call.type!r} are not supported", "messages"
                )
        return tuple((c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type == "image_url":
                continue  # images()
            if part.type != "text" or part.text is None:
                raise ServiceError(
                    Code.INVALID_ARGUMENT,
                    f"messages: content parts of type {part.type!r} are not supported (text and image_url)",
                    "messages",
                )
            parts.append(part.text)
        return "".join(parts)

    def images(self, index: int) -> tuple[bytes, ...]:
        """Its ``image_url`` parts' images (data: URLs), laid out before its text."""
        out = []
        for number, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if part.type == "image_url":
                url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
                if not isinstance(url, str):
                    raise ServiceError(
                        Code.INVALID_ARGUMENT, f"messages[{index}].content[{number}].image_url: needs a url", "messages"
                    )
                out.append(images.from_url(url, f"messages[{index}].content[{number}]"))
        return tuple(out)


class StreamOptions(Schema):
    include_usage: StrictBool = False


class JsonSchemaFormat(Schema):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(Schema):
    type: StrictStr
    json_schema: JsonSchemaFormat | None = None


def grammar_of(
    response_format: ResponseFormat | None,
    guided_json=None,
    guided_regex: str | None = None,
    guided_grammar: str | None = None,
    guided_choice: list | None = None,
) -> str:
    """The runner's ``grammar`` field (runner.constraint) for OpenAI's ``response_format`` or vLLM's ``guided_*``
    extensions (at most one of them); "" for free text."""
    asked = [
        (name, value)
        for name, value in (
            ("response_format", response_format if response_format and response_format.type != "text" else None),
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_grammar", guided_grammar),
            ("guided_choice", guided_choice),
        )
        if value is not None
    ]
    if not asked:
        return ""
    if len(asked) > 1:
        raise ServiceError(
            Code.INVALID_ARGUMENT, f"{asked[1][0]}: set one of {asked[0][0]} and {asked[1][0]}", asked[1][0]
        )
    name, value = asked[0]
    if name == "response_format":
        if value.type == "json_object":
            return json.dumps({"json_object": True})
        if value.type != "json_schema":
            raise ServiceError(
                Code.INVALID_ARGUMENT,
                f"response_format.type: {value.type!r} is not one of text, json_object, json_schema",
                "response_format.type",
            )
        if value.json_schema is None or value.json_schema.schema_ is None:
            raise ServiceError(
                Code.INVALID_ARGUMENT, "response_format.json_schema.schema: missing", "response_format.json_schema"
            )
        return json.dumps({"json_schema": value.json_schema.schema_})
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ServiceError(Code.INVALID_ARGUMENT, "guided_json: is not JSON", name) from None
        if not isinstance(value, dict):
            raise ServiceError(Code.INVALID_ARGUMENT, "guided_json: must be a JSON schema (an object)", name)
        return json.dumps({"json_schema": value})
    if name == "guided_choice":
        if not value or not all(isinstance(choice, str) and choice for choice in value):
            raise ServiceError(Code.INVALID_ARGUMENT, "guided_choice: must be a list of non-empty strings", name)
        return json.dumps({"lark": "start: " + " | ".join(json.dumps(choice) for choice in value)})
    if not isinstance(value, str):
        raise ServiceError(Code.INVALID_ARGUMENT, f"{name}: must be a string", name)
    return json.dumps({"regex": value} if name == "guided_regex" else {"lark": value})


def in_own_words(error: ServiceError, body) -> ServiceError:
    """A runner's refusal of the ``grammar`` it was sent, naming the field of this request that asked for it
    (``response_format`` or a ``guided_*``)."""
    asked = body.grammar_field() if error.param == "grammar" else None
    if asked is None:
        return error
    message = (
        error.message.replace("grammar:", f"{asked}:", 1) if error.message.startswith("grammar:") else error.message
    )
    return ServiceError(error.code, message, asked)


class Sampling(Schema):
    """The fields chat and completions share. Unknown fields are kept aside (``model_extra``) so that one
    this server cannot honour is refused (``NOT_HONOURED``); others are ignored."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Extensions (vLLM and this project's own)
    ignore_eos: StrictBool = False
    num_draft_tokens: StrictInt | None = None
    drafter: StrictStr | None = None
    # Constrained output: OpenAI's response_format (chat), vLLM's guided_* (both APIs); runner.constraint
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_grammar: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    logit_bias: dict[str, Number] | None = None
    # Penalties (runner.penalties): OpenAI's, and repetition_penalty (vLLM's and mlx-lm's extension)
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None

    def sampling_fields(self, max_tokens: int | None) -> dict:
        """The shared fields as ``common.requests.check_fields`` and the message take them, OpenAI's defaults
        filled in."""
        refuse_not_honoured(self.model_extra, NOT_HONOURED)
        if self.n < 1:  # the message's 0 means "not set"; a client's 0 asks for no answer, which OpenAI refuses
            raise ServiceError(Code.INVALID_ARGUMENT, f"n: must lie in [1, {MAX_CHOICES}]", "n")
        return {
            "max_tokens": MAX_TOKENS_UNSET if max_tokens is None else max_tokens,
            "temperature": 1.0 if self.temperature is None else float(self.temperature),  # OpenAI's default
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "top_k": self.top_k or 0,
            "min_p": float(self.min_p or 0.0),
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or ()),
            "n": self.n,  # choices: one shared prefill, rows of one batch (judged by check_fields)
            "num_draft_tokens": self.num_draft_tokens,
            "drafter": self.drafter or "",
            "grammar": grammar_of(
                self.response_format, self.guided_json, self.guided_regex, self.guided_grammar, self.guided_choice
            ),
            "logit_bias": self.token_biases(),
            # Judged by check_fields as they are (by comparison: a huge integer or NaN is a 400, not a crash).
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "defaulted": left_out(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p),
        }

    def grammar_field(self) -> str | None:
        """The field that asked for a grammar, if one did."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        names = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
        return next((name for name in names if getattr(self, name) is not None), None)

    def token_biases(self) -> dict[int, int | float]:
        """OpenAI's logit_bias: token ids (as JSON object keys, so strings) to numbers, judged by
        ``check_fields``."""
        biases = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                message = f"logit_bias: keys must be token ids, not {key!r}"
                raise ServiceError(Code.INVALID_ARGUMENT, message, "logit_bias")
            biases[int(key)] = value
        return biases

    def build(self, fields: dict, messages=()) -> supervisor_pb2.GenerateRequest:
        return build_request(self.model, fields, messages, ignore_eos=self.ignore_eos)


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calls (common.tool_calls): checked there, as for the gRPC API
    tools: list[Any] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # A model that thinks (common.reasoning): OpenAI's effort ("none" turns it off; a budget for a model that
    # thinks in a block), and this server's budget of reasoning tokens (its end forced there).
    reasoning_effort: StrictStr | None = None
    reasoning_budget: StrictInt | None = None

    def tool_fields(self) -> dict:
        """tools, tool_choice and parallel_tool_calls as the message takes them."""
        choice, name = self.tool_choice, ""
        wrong = 'tool_choice: must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise ServiceError(Code.INVALID_ARGUMENT, wrong, "tool_choice")
            choice = "function"
        elif choice == "function":  # the message's own word for a named function, not OpenAI's
            raise ServiceError(Code.INVALID_ARGUMENT, wrong, "tool_choice")
        return {
            "tools": json.dumps(self.tools, ensure_ascii=False) if self.tools else "",
            "tool_choice": choice or "",
            "tool_name": name,
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def to_proto(self) -> supervisor_pb2.GenerateRequest:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        fields = self.sampling_fields(max_tokens)
        fields.update(
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            chat_template_kwargs=json.dumps(self.chat_template_kwargs) if self.chat_template_kwargs else "",
            reasoning_effort=self.reasoning_effort or "",
            reasoning_budget=self.reasoning_budget,
            **self.tool_fields(),
        )
        messages = [
            (
                "system" if m.role == "developer" else m.role,
                m.text(),
                m.name or "",
                m.tool_call_id or "",
                m.calls(),
                m.reasoning_content or m.reasoning or "",
                m.images(index),
            )
            for index, m in enumerate(self.messages)
        ]
        return self.build(fields, messages)


class CompletionRequest(Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None

    def to_proto(self) -> supervisor_pb2.GenerateRequest:
        if self.suffix:
            raise ServiceError(Code.INVALID_ARGUMENT, "suffix: not supported", "suffix")
        for name in ("reasoning_effort", "reasoning_budget"):  # a prompt is the model's text as it is
            if (self.model_extra or {}).get(name) not in (None, "none"):
                message = f"{name}: goes with a chat (/v1/chat/completions), not a prompt"
                raise ServiceError(Code.INVALID_ARGUMENT, message, name)
        fields = self.sampling_fields(16 if self.max_tokens is None else self.max_tokens)  # OpenAI's default
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ServiceError(Code.INVALID_ARGUMENT, "prompt: one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            fields["prompt"] = prompt
        else:
            fields["prompt_ids"] = list(prompt)
        if self.logprobs is not None:
            fields.update(logprobs=True, top_logprobs=self.logprobs)
        if self.echo and (self.logprobs is not None or "prompt_ids" in fields):
            fields["prompt_logprobs"] = True  # the prompt's tokens, scored (and their text, for a token prompt)
        return self.build(fields)

    def echoed(self) -> str | None:
        """The prompt's text to put before the answer (echo), when it is known here; None otherwise (the runner
        gives its tokens, ``prompt_logprobs``)."""
        if not self.echo or self.logprobs is not None:
            return None
        prompt = self.prompt
        return prompt if isinstance(prompt, str) else prompt[0] if prompt and isinstance(prompt[0], str) else None


# -- responses -----------------------------------------------------------------------------------------


def usage(stats: runner_pb2.GenerationStats, completion_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``completion_tokens``: of all the choices, when there are several."""
    completion = stats.generated_tokens if completion_tokens is None else completion_tokens
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": stats.reasoning_tokens},
    }


def completion_logprobs(entries, offset: int, prompt=()) -> dict:
    """The legacy completions' logprobs; ``prompt``: the prompt's scored tokens first (echo), the first of
    them with no logprob (null), as OpenAI gives it."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for index, e in enumerate([*prompt, *entries]):
        unscored = index == 0 and bool(prompt)
        tokens.append(e.token)
        token_logprobs.append(None if unscored else e.logprob)
        # The chosen token among its alternatives, as OpenAI and vLLM give it (logprobs 0: the chosen one alone).
        top.append(None if unscored else {e.token: e.logprob, **{t.token: t.logprob for t in e.top}})
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def tool_call_deltas(deltas) -> list[dict]:
    """One chunk's call pieces as OpenAI streams them: one entry per call (a call's first piece and the arguments
    that came with it in one chunk are one entry, as OpenAI never sends two entries of one index in a delta)."""
    out: list[dict] = []
    for delta in deltas:
        piece = tool_call_delta(delta)
        if out and out[-1]["index"] == delta.index and not delta.id:
            out[-1]["function"]["arguments"] += delta.arguments
        else:
            out.append(piece)
    return out


def tool_call_delta(delta) -> dict:
    """A runner ToolCallDelta as OpenAI streams it: the first piece of a call has its id, type and name."""
    piece: dict = {"index": delta.index, "function": {"arguments": delta.arguments}}
    if delta.id:
        piece = {"index": delta.index, "id": delta.id, "type": "function"}
        piece["function"] = {"name": delta.name, "arguments": delta.arguments}
    return piece


class Answer:
    """Builds the OpenAI objects of one answer (chat or text completion) from the runner's chunks."""

    def __init__(self, kind: str, model: str, logprobs: bool, n: int = 1, echo: bool = False, echoed=None):
        self.chat = kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.model = model
        self.logprobs = logprobs
        self.n = max(1, n)
        self.text_length: dict[int, int] = {}  # per choice: its text so far (completion logprobs' offsets)
        self.finals: dict[int, object] = {}  # per choice: its stats, once it ended
        self.echo = echo  # completions: the prompt before each answer
        self.echoed = echoed  # its text when known here, else from the runner's scored prompt tokens
        self.opened: set[int] = set()  # choices whose first chunk went out

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, chunks: list) -> dict:
        last = chunks[-1]
        text = "".join(c.text for c in chunks)
        entries = [e for c in chunks for e in c.logprobs]
        choice: dict = {"index": index, "finish_reason": FINISH_REASONS.get(last.finish_reason, "stop")}
        if self.chat:
            calls = tool_calls([d for c in chunks for d in c.tool_calls])
            choice["message"] = {"role": "assistant", "content": text if text or not calls else None}
            reasoning = "".join(c.reasoning for c in chunks)
            if reasoning:  # a model that thinks apart: its reasoning, as DeepSeek's, vLLM's and llama.cpp's APIs
                choice["message"]["reasoning_content"] = reasoning
            if calls:
                choice["message"]["tool_calls"] = calls
            choice["logprobs"] = {"content": chat_logprobs(entries)} if self.logprobs else None
        else:
            prompt = [e for c in chunks for e in c.prompt_logprobs] if self.echo else []
            choice["text"] = self._echo(chunks[0]) + text
            choice["logprobs"] = completion_logprobs(entries, 0, prompt) if self.logprobs else None
        return choice

    def _echo(self, first) -> str:
        """The prompt's text to put before a choice's answer (echo); "" without echo."""
        if not self.echo:
            return ""
        return self.echoed if self.echoed is not None else "".join(e.token for e in first.prompt_logprobs)

    def whole(self, chunks: list) -> dict:
        by_choice: dict[int, list] = {}
        for chunk in chunks:
            by_choice.setdefault(chunk.choice, []).append(chunk)
        body = self._base("chat.completion" if self.chat else "text_completion")
        body["choices"] = [self._choice(index, by_choice[index]) for index in sorted(by_choice)]
        finals = [by_choice[index][-1].stats for index in sorted(by_choice)]
        body["usage"] = usage(finals[0], sum(f.generated_tokens for f in finals))
        body["x_mlxserve"] = speculation(finals[0])
        return body

    def first_event(self) -> dict | None:
        """Chat streams open with the assistant's role (for each choice)."""
        if not self.chat:
            return None
        return {
            **self._base("chat.completion.chunk"),
            "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.n)
            ],
        }

    def event(self, chunk) -> dict | None:
        finish = FINISH_REASONS.get(chunk.finish_reason) if chunk.finish_reason else None
        if chunk.HasField("stats"):
            self.finals[chunk.choice] = chunk.stats
        opening = self.echo and chunk.choice not in self.opened  # its echo goes out with its first chunk
        quiet = not chunk.text and not chunk.reasoning and not chunk.logprobs and not chunk.tool_calls
        if quiet and finish is None and not opening:
            return None
        index = chunk.choice
        if self.chat:
            delta = {"content": chunk.text} if chunk.text else {}
            if chunk.reasoning:
                delta["reasoning_content"] = chunk.reasoning
            if chunk.tool_calls:
                delta["tool_calls"] = tool_call_deltas(chunk.tool_calls)
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": {"content": chat_logprobs(chunk.logprobs)} if self.logprobs else None,
                "finish_reason": finish,
            }
            body = self._base("chat.completion.chunk")
        else:
            offset = self.text_length.get(index, 0)
            first = index not in self.opened
            self.opened.add(index)
            prefix = self._echo(chunk) if first else ""
            prompt = list(chunk.prompt_logprobs) if first and self.echo else []
            choice = {
                "index": index,
                "text": prefix + chunk.text,
                "finish_reason": finish,
                "logprobs": completion_logprobs(chunk.logprobs, offset, prompt) if self.logprobs else None,
            }
            body = self._base("text_completion")
            self.text_length[index] = offset + len(prefix)
        self.text_length[index] = self.text_length.get(index, 0) + len(chunk.text)
        body["choices"] = [choice]
        if chunk.HasField("stats"):
            body["x_mlxserve"] = speculation(chunk.stats)
        return body

    @property
    def all_ended(self) -> bool:
        return len(self.finals) == self.n

    def usage_event(self) -> dict:
        """The usage of every choice, once all have ended."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        finals = [self.finals[i] for i in sorted(self.finals)]
        return {**self._base(obj), "choices": [], "usage": usage(finals[0], sum(f.generated_tokens for f in finals))}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


# -- the app -------------------------------------------------------------------------------------------


async def logged_error_response(error: BaseException, request: Request) -> JSONResponse:
    """``error_response``, and its log line (``log_refusal``)."""
    response = error_response(error, request)
    await log_refusal(request, response.status_code, status_of(error).message)
    return response


def error_response(error: BaseException, request: Request | None = None) -> JSONResponse:
    """The error in the shape of the API the request spoke: Anthropic's under /v1/messages, Ollama's under /api/,
    else OpenAI's."""
    if request is not None and request.url.path.startswith("/v1/messages"):
        from .anthropic_api import anthropic_error

        status, body = anthropic_error(status_of(error))
    elif request is not None and request.url.path.startswith("/api/"):
        from .ollama_api import ollama_error

        status, body = ollama_error(status_of(error))
    else:
        responses = request is not None and request.url.path.startswith("/v1/responses")
        status, body = openai_error(status_of(error), "input" if responses else None)
    return JSONResponse(body, status_code=status)


def create_app(supervisor) -> FastAPI:
    """The ASGI app over one ``Supervisor`` (anything with ``generate``, ``config`` and ``scheduler``)."""
    app = FastAPI(title="mlxserve", version="1", docs_url=None, redoc_url=None)
    app.add_middleware(RequestIds)
    token = supervisor.config.auth_token

    def authorized(request: Request) -> None:
        """The token as a bearer token, or as Anthropic's x-api-key header."""
        if (
            token
            and request.headers.get("authorization") != f"Bearer {token}"
            and request.headers.get("x-api-key") != token
        ):
            raise ServiceError(
                Code.UNAUTHENTICATED, "missing or wrong token (Authorization: Bearer ..., or x-api-key: ...)"
            )

    @app.exception_handler(ServiceError)
    async def service_error(request: Request, error: ServiceError):
        return await logged_error_response(error, request)

    @app.exception_handler(InvalidRequest)
    async def invalid_field(request: Request, error: InvalidRequest):  # common.requests.check_fields
        return await logged_error_response(error, request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        problem = error.errors()[0]
        location = [str(part) for part in problem.get("loc", ()) if part != "body"]
        if problem.get("type") == "json_invalid":
            refusal = ServiceError(Code.INVALID_ARGUMENT, "the request body is not valid JSON")
            return await logged_error_response(refusal, request)
        param = location[0] if location else None
        where = ".".join(location) or "body"
        why = str(problem.get("msg", "")).removeprefix("Value error, ")  # pydantic's prefix for a validator's
        refusal = ServiceError(Code.INVALID_ARGUMENT, f"{where}: {why}", param)
        return await logged_error_response(refusal, request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: Code.NOT_FOUND, 405: Code.UNIMPLEMENTED}.get(error.status_code, Code.INVALID_ARGUMENT)
        refusal = ServiceError(code, f"{request.method} {request.url.path}: {error.detail}")
        response = error_response(refusal, request)
        response.status_code = error.status_code
        await log_refusal(request, error.status_code, refusal.message)
        return response

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        """Anything else is a bug: still an answer in the API's shape (500), logged with its traceback."""
        log.error("%s %s failed", request.method, request.url.path, exc_info=error)
        return await logged_error_response(error, request)

    def cached_names() -> list[str]:
        return supervisor.scheduler.cached_names()

    def model_object(name: str, anthropic: bool) -> dict:
        """A model as OpenAI lists it, or Anthropic (its clients send ``anthropic-version``), with the limits a
        client may plan by once the model has loaded: its context (also as vLLM's ``max_model_len``) and the
        most tokens an answer may have (``max_output_tokens``, when the model's setting caps it)."""
        created = int(supervisor.started_at)
        out: dict = {"id": name, "object": "model", "created": created, "owned_by": "mlxserve"}
        if anthropic:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
            out = {"type": "model", "id": name, "display_name": name, "created_at": stamp}
        runner = supervisor.scheduler.runners.get(name.rpartition(":")[0] if ":" in name else name)
        runner = runner or supervisor.scheduler.runners.get(name)  # None: a hub repository in the cache
        info = runner.info if runner is not None else None
        if info is not None:
            out["context_length"] = out["max_model_len"] = info.target.context_length
            if info.max_output_tokens:
                out["max_output_tokens"] = info.max_output_tokens
        return out

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models(request: Request):
        anthropic = "anthropic-version" in request.headers
        adapted = [
            f"{name}:{adapter}"
            for name, model in supervisor.config.models.items()
            for adapter in adapter_folders(model.runner.adapters)
        ]
        names = [*list(supervisor.scheduler.runners), *adapted, *await run_in_threadpool(cached_names)]
        listed = [model_object(name, anthropic) for name in names]
        if anthropic:
            ids = [m["id"] for m in listed]
            first, last = (ids[0], ids[-1]) if ids else (None, None)
            return {"data": listed, "has_more": False, "first_id": first, "last_id": last}
        return {"object": "list", "data": listed}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str, request: Request):
        supervisor.scheduler.runner(with_adapter(supervisor.config, model_id)[0])  # NOT_FOUND naming the models
        return model_object(model_id, "anthropic-version" in request.headers)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat(body: ChatCompletionRequest, request: Request):
        return await answer(request, body, "chat", body.logprobs)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest, request: Request):
        return await answer(request, body, "text", body.logprobs is not None)

    async def answer(request: Request, body, kind: str, logprobs: bool):
        proto = body.to_proto()
        generation = supervisor.generate(proto, timeout=None)
        echo = kind == "text" and body.echo
        out = Answer(kind, body.model, logprobs, body.n, echo, body.echoed() if echo else None)
        try:
            if body.stream:
                return await stream(
                    request, generation, out, bool(body.stream_options and body.stream_options.include_usage)
                )
            return await whole(request, generation, out)
        except ServiceError as error:
            raise in_own_words(error, body) from None

    async def until_done(request: Request, generation, work):
        """``await work()`` (a generation's chunks, or its first); a client that disconnects meanwhile cancels
        the generation."""
        return await while_connected(request, work(), generation.cancel)

    async def whole(request: Request, generation, out: Answer):
        return out.whole(await until_done(request, generation, generation.collect))

    async def stream(request: Request, generation, out: Answer, include_usage: bool):
        chunks = aiter(generation)
        # The first chunk decides between an error status and a 200 stream.
        first = await until_done(request, generation, lambda: anext(chunks, None))

        async def events():
            chunk = first
            try:
                opening = out.first_event()
                if opening is not None:
                    yield sse(opening)
                while chunk is not None:
                    event = out.event(chunk)
                    if event is not None:
                        yield sse(event)
                    if chunk.HasField("stats") and include_usage and out.all_ended:
                        yield sse(out.usage_event())
                    chunk = await anext(chunks, None)
            except ServiceError as error:
                status, shaped = openai_error(error)
                await log_refusal(request, status, f"(in the stream) {error.message}")
                yield sse(shaped)
            yield sse("[DONE]")

        return EventStream(events(), generation, chunks)

    from . import anthropic_api, embeddings_api, ollama_api, responses_api, web_ui

    if supervisor.config.web_page:  # before Ollama's routes: a browser's GET / is the page, anyone else's Ollama's
        web_ui.register(app, supervisor, authorized)
    embeddings_api.register(app, supervisor, authorized)
    anthropic_api.register(app, supervisor, authorized, until_done)
    ollama_api.register(app, supervisor, authorized, until_done)
    responses_api.register(app, supervisor, authorized, until_done)
    return app


class HttpServer:
    """uvicorn serving the app on the front door's loop; the socket is bound up front, so a busy port fails
    start-up."""

    def __init__(self, app: FastAPI, listen: str, tls_cert=None, tls_key=None, grace: float = 10.0):
        import uvicorn

        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on a connection whose
        # socket says it is TCP, and accepted sockets take the listener's. Left on, uvicorn's two writes of an answer
        # (its headers, then its body) waited for the client's delayed ACK of the first: 40 ms added to every
        # non-streamed answer after a connection's first (measured: 44 ms for GET /v1/models, 4 ms without).
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Every connection's send buffer fixed (connections inherit it from the listening socket), not grown by
        # the kernel up to 4 MiB: a client that stops reading stops its stream after this and uvicorn's 64 KiB,
        # and its rounds wait in the runner, bounded there (``max_pending_rounds``).
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        try:
            self.socket.bind((host, int(port)))
        except OSError as error:
            self.socket.close()
            raise OSError(f"http_listen {listen}: {error.strerror}") from None
        self.socket.listen(512)
        self.port = self.socket.getsockname()[1]
        self.scheme = "https" if tls_cert else "http"
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=30,
            timeout_graceful_shutdown=grace,
            ssl_certfile=str(tls_cert) if tls_cert else None,
            ssl_keyfile=str(tls_key) if tls_key else None,
        )
        self.server = uvicorn.Server(config)
        self._serving = None  # concurrent.futures.Future of serve() on the front door's loop

    def start(self, front) -> None:
        self._serving = front.submit(self.server.serve(sockets=[self.socket]))

    def begin_stop(self) -> None:
        """No new connections; answers in flight go on (their generations end with the runners)."""
        self.server.should_exit = True

    def stop(self, timeout: float = 5.0) -> None:
        self.server.should_exit = True
        if self._serving is not None:
            try:
                self._serving.result(timeout)
            except Exception as error:  # noqa: BLE001 - stopping goes on; say why this one did not stop cleanly
                log.warning("HTTP server on port %d did not stop cleanly: %r", self.port, error)
