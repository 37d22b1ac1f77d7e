"""Ollama's native API over the supervisor (so Open WebUI, Continue, LangChain's ``ChatOllama`` and the
``ollama`` client work against it).

    POST /api/chat, /api/generate   NDJSON streaming (on by default) or one object
    GET  /api/tags, /api/ps, /api/version;  POST /api/show
    /api/pull, /api/create, ...     a clear "not supported here" (models come from the TOML config)

A thin adapter, like the OpenAI and Anthropic ones: the request becomes the
internal request (``http_common.build_request``) and takes the one generate
path. ``options`` map onto its fields (temperature, top_k, top_p, min_p, seed,
num_predict, stop, repeat_penalty, presence and frequency penalties, and
``num_ctx`` as the context this request may fill); ``format`` ("json" or a
schema) becomes the grammar; ``tools`` and a history with ``tool_calls`` and
``tool_name`` take issue #21's tool path (calls come whole, their arguments as
objects, in one message chunk as Ollama sends them). Options that tune
Ollama's own runtime (``num_gpu``, ``num_thread``, ``use_mmap``, ...) have no
meaning here and change nothing; sampling options this server does not have
(``mirostat``, ``tfs_z``, ``typical_p``) are refused unless neutral.

``keep_alive`` maps onto loading and unloading: ``0`` unloads the model once
the request is done (an empty ``/api/generate`` or ``/api/chat`` with it
unloads at once, ``done_reason: "unload"``), a duration unloads it after that
long idle, a negative one keeps it; an empty request loads the model
(``done_reason: "load"``). Errors have Ollama's shape, ``{"error": "..."}``.
Durations are nanoseconds, counts as Ollama names them (``prompt_eval_count``:
the prompt tokens prefilled; the prompt cache's are not counted again).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from common import __version__, images
from common.requests import FinishReason
from common.status import Code, ServiceError

from . import hub
from .http_common import (
    EventStream,
    Number,
    Schema,
    build_request,
    finite,
    load_while_connected,
    log_refusal,
    tool_calls,
)
from .http_errors import http_status, in_api_words

OLLAMA_VERSION = "0.12.0"  # the API level answered at /api/version (clients check it for features)
MAX_TOKENS_UNSET = 2**31 - 1  # num_predict -1 or -2: until the model stops or the context is full
# Ollama's documented defaults for the sampling options a request leaves out.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Options that tune Ollama's own runtime: nothing to do with them here.
RUNTIME_OPTIONS = {
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "f16_kv",
    "logits_all",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "embedding_only",
    "num_thread",
    "num_keep",
    # mirostat's own settings: meaningless unless mirostat is on, which is refused
    "mirostat_tau",
    "mirostat_eta",
}
# Sampling options this server does not have: refused unless they ask for nothing.
NOT_HONOURED = {
    "mirostat": lambda v: v not in (None, 0),
    "tfs_z": lambda v: v not in (None, 1, 1.0),
    "typical_p": lambda v: v not in (None, 1, 1.0),
    "penalize_newline": lambda v: v not in (None, True),
}
TAKEN = {"temperature", "top_k", "top_p", "min_p", "seed", "num_predict", "stop", "num_ctx"}
TAKEN |= {"repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n"}
TAKEN |= {"reasoning_budget"}  # this server's: the most reasoning tokens of a model that thinks (its end forced)
NOT_HERE = ("push", "create", "copy", "blobs")  # /api/embed and /api/embeddings: supervisor/embeddings_api.py


def _base64_text(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{where}: an image is base64 text", "images")
    return value


def ollama_error(error: ServiceError) -> tuple[int, dict]:
    error = in_api_words(
        error,
        {
            **{name: ("think", "think") for name in ("think", "reasoning_effort")},
            "reasoning_budget": ("options", "options.reasoning_budget"),
        },
    )
    if error.exceeded is not None:  # Ollama's words (as it answers with truncate false)
        exceeded = error.exceeded
        size = f"the available context size ({exceeded.context} tokens)"
        message = f"request ({exceeded.amount}) exceeds {size}, try increasing it"
        return http_status(error.code), {"error": message}
    return http_status(error.code), {"error": error.message}


def bad(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message, param)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


async def keep_alive(supervisor, name: str, seconds: float | None) -> None:
    """A request's keep_alive (``keep_alive_seconds``) applied to its model once it is answered: 0 unloads it now
    unless another request is under way, another time is how long it stays loaded idle; None changes nothing."""
    if seconds is None:
        return
    runner = supervisor.scheduler.runner(name)
    if seconds == 0:
        runner.keep_alive = None
        if runner.in_flight == 0:
            await run_in_threadpool(supervisor.scheduler.unload, name, "keep_alive 0 (Ollama API)")
    else:
        runner.keep_alive = seconds


def keep_alive_seconds(value) -> float | None:
    """Ollama's keep_alive (seconds as a number, or a duration such as "5m", "1h30m", "-1") in seconds; None
    when absent; math.inf for a negative one (keep it loaded)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad("keep_alive: must be a duration (such as 5m) or a number of seconds", "keep_alive")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        match = re.fullmatch(r"(-?)((?:\d+(?:\.\d+)?(?:h|m|s|ms))+|\d+(?:\.\d+)?)", text)
        if match is None:
            raise bad(f"keep_alive: {value!r} is not a duration (such as 5m, 1h, 30s or -1)", "keep_alive")
        units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
        parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)?", match.group(2))
        seconds = sum(float(number) * units[unit or "s"] for number, unit in parts)
        if match.group(1):
            seconds = -seconds
    if not math.isfinite(seconds):
        raise bad("keep_alive: must be finite", "keep_alive")
    return math.inf if seconds < 0 else seconds


# -- requests ----------------------------------------------------------------------------------------------


class ToolFunction(Schema):
    name: StrictStr
    arguments: dict[str, Any] | StrictStr = {}


class ToolCall(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    function: ToolFunction


class Message(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    role: StrictStr
    content: StrictStr = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: StrictStr | None = None
    thinking: StrictStr | None = None  # an earlier turn's reasoning: its template decides (most drop it)


class OllamaRequest(Schema):
    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr
    format: StrictStr | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: StrictBool = True
    keep_alive: StrictStr | Number | None = None
    think: StrictBool | StrictStr | None = None
    logprobs: StrictBool | None = None

    def fields(self) -> dict:
        """The internal request's sampling fields from ``options``, ``format`` and Ollama's defaults."""
        if self.logprobs:
            raise bad("logprobs: not supported on this API; use the OpenAI API's", "logprobs")
        options = dict(self.options or {})
        for key, value in options.items():
            refused = NOT_HONOURED.get(key)
            if refused is not None and refused(value):
                raise bad(f"options.{key}: not supported by this server; leave it out", "options")
            if key not in TAKEN and key not in RUNTIME_OPTIONS and key not in NOT_HONOURED:
                raise bad(f"options.{key}: not an option this server knows", "options")
        if options.get("repeat_last_n") not in (None, -1, 0) and options.get("repeat_penalty") not in (None, 1, 1.0):
            raise bad("options.repeat_last_n: the repeat penalty looks at the whole context here (-1)", "options")
        predict = options.get("num_predict")
        stop = options.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        number = (int, float)
        for key in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            if key in options and (isinstance(options[key], bool) or not isinstance(options[key], number)):
                raise bad(f"options.{key}: must be a number", "options")
            if key in options:
                try:
                    finite(options[key])
                except ValueError as error:
                    raise bad(f"options.{key}: {error}", "options") from None
        for key in ("top_k", "seed", "num_predict", "num_ctx", "reasoning_budget"):
            if key in options and (isinstance(options[key], bool) or not isinstance(options[key], int)):
                raise bad(f"options.{key}: must be an integer", "options")
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad("options.stop: must be a list of strings", "options")
        return {
            "max_tokens": MAX_TOKENS_UNSET if predict is None or predict < 0 else max(predict, 1),
            "temperature": options.get("temperature", DEFAULTS["temperature"]),
            "top_p": options.get("top_p", DEFAULTS["top_p"]),
            "top_k": options.get("top_k", DEFAULTS["top_k"]),
            "min_p": options.get("min_p", 0.0),
            "seed": options.get("seed"),
            "stop": stop,
            "repetition_penalty": options.get("repeat_penalty", 1.0),
            "presence_penalty": options.get("presence_penalty", 0.0),
            "frequency_penalty": options.get("frequency_penalty", 0.0),
            "max_context": max(options.get("num_ctx") or 0, 0),
            "grammar": self.grammar(),
            **self.thinking_fields(),
            **({"reasoning_budget": options["reasoning_budget"]} if "reasoning_budget" in options else {}),
            "defaulted": [name for name in ("temperature", "top_p", "top_k", "min_p") if name not in options],
        }

    def thinking_fields(self) -> dict:
        """``think`` as the runner's switches: true / false, or an effort ("low", "medium", "high")."""
        think = self.think
        if think in (None, ""):
            return {}
        if think in (True, "true"):
            return {"think": "on"}
        if think in (False, "false"):
            return {"think": "off"}
        if think in ("low", "medium", "high"):
            return {"think": "on", "reasoning_effort": think}
        raise bad(f'think: must be true, false, "low", "medium" or "high", not {think!r}', "think")

    def grammar(self) -> str:
        if self.format in (None, ""):
            return ""
        if self.format == "json":
            return json.dumps({"json_object": True})
        if isinstance(self.format, dict):
            return json.dumps({"json_schema": self.format})
        raise bad(f'format: must be "json" or a JSON schema, not {self.format!r}', "format")


class ChatRequest(OllamaRequest):
    messages: list[Message] = []
    tools: list[dict[str, Any]] | None = None

    def conversation(self) -> list[tuple]:
        out = []
        for index, message in enumerate(self.messages):
            pictures = tuple(
                images.from_base64(
                    _base64_text(picture, f"messages.{index}.images.{k}"), f"messages.{index}.images.{k}"
                )
                for k, picture in enumerate(message.images or ())
            )
            calls = []
            for number, call in enumerate(message.tool_calls or ()):
                arguments = call.function.arguments
                text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
                calls.append((f"call_{index}_{number}", call.function.name, text))
            thinking = message.thinking or ""
            out.append((message.role, message.content, message.tool_name or "", "", tuple(calls), thinking, pictures))
        return out

    def to_proto(self):
        fields = self.fields()
        if self.tools:
            fields["tools"] = json.dumps(self.tools, ensure_ascii=False)
        return build_request(self.model, fields, self.conversation())


class GenerateRequest(OllamaRequest):
    prompt: StrictStr = ""
    suffix: StrictStr | None = None
    system: StrictStr | None = None
    template: StrictStr | None = None
    context: list[StrictInt] | None = None
    raw: StrictBool = False
    images: list[Any] | None = None

    def to_proto(self, chat_template: bool):
        """With the model's chat template (``raw`` off and the model has one): the prompt as the user's turn."""
        for name in ("suffix", "template"):
            if getattr(self, name):
                raise bad(f"{name}: not supported by this server", name)
        pictures = tuple(
            images.from_base64(_base64_text(p, f"images.{k}"), f"images.{k}", "images")
            for k, p in enumerate(self.images or ())
        )
        # context: an earlier answer's (its prompt's and answer's tokens) goes before this prompt, as Ollama's
        fields = {**self.fields(), "context_ids": list(self.context or ()), "return_prompt_ids": True}
        if self.raw or not chat_template:
            if pictures:
                raise bad("images: need the model's chat template (raw off, a model that has one)", "images")
            if self.system:
                raise bad("system: needs the model's chat template (raw off, a model that has one)", "system")
            return build_request(self.model, {**fields, "prompt": self.prompt})
        messages = [("system", self.system, "", "", ())] if self.system else []
        messages.append(("user", self.prompt, "", "", (), "", pictures))
        return build_request(self.model, fields, messages)


class PullRequest(Schema):
    """Ollama's pull and delete: the model (``name`` in older clients)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: StrictStr | None = None
    name_: StrictStr | None = Field(default=None, alias="name")
    stream: StrictBool = True
    insecure: StrictBool = False

    def name(self) -> str:
        name = self.model or self.name_
        if not name:
            raise bad("model: required", "model")
        return name


def pull_record(progress) -> dict:
    """A pull step as Ollama's progress record."""
    record = {"status": progress.status}
    if progress.total:
        record.update(digest=progress.digest, total=progress.total, completed=progress.completed)
    return record


# -- answers ---------------------------------------------------------------------------------------------------


def done_reason(chunk) -> str:
    return "length" if chunk.finish_reason == FinishReason.LENGTH else "stop"


def timings(stats, total: float, load: float) -> dict:
    ns = 1_000_000_000
    return {
        "total_duration": int(total * ns),
        "load_duration": int(load * ns),
        "prompt_eval_count": stats.prompt_tokens - stats.cached_tokens,
        "prompt_eval_duration": int(stats.prefill_s * ns),
        "eval_count": stats.generated_tokens,
        "eval_duration": int(stats.decode_s * ns),
    }


def ollama_calls(deltas) -> list[dict]:
    calls = []
    for index, call in enumerate(tool_calls(deltas)):
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except ValueError:  # cut short by num_predict
            arguments = {}
        calls.append(
            {"id": call["id"], "function": {"index": index, "name": call["function"]["name"], "arguments": arguments}}
        )
    return calls


# -- routes ------------------------------------------------------------------------------------------------------


class JsonBodies:
    """ASGI middleware: a POST under /api/ is JSON whatever its Content-Type says. Ollama reads the body as JSON
    regardless, and its documented examples send it with ``curl -d``, which says form-encoded."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].startswith("/api/"):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def register(app: FastAPI, supervisor, authorized, until_done) -> None:
    """Add Ollama's routes to the HTTP API's app."""
    app.add_middleware(JsonBodies)

    def details(name: str) -> dict:
        runner = supervisor.scheduler.runner(name)
        info = runner.info.target if runner.info is not None else None
        architecture = info.architecture if info is not None else ""
        bits = info.quantization_bits if info is not None else 0
        return {
            "parent_model": "",
            "format": "gguf" if str(runner.model.target).endswith(".gguf") else "safetensors",
            "family": architecture,
            "families": [architecture] if architecture else [],
            "parameter_size": f"{info.parameters / 1e6:.0f}M" if info is not None and info.parameters else "",
            "quantization_level": f"Q{bits}" if bits else (info.dtype if info is not None else ""),
        }

    def size(name: str) -> int:
        return supervisor.status(supervisor.scheduler.runner(name)).memory.estimate

    def modified(name: str) -> str:
        target = supervisor.scheduler.runner(name).model.target
        try:
            stamp = target.stat().st_mtime
        except OSError:
            stamp = supervisor.started_at
        return datetime.datetime.fromtimestamp(stamp, datetime.UTC).isoformat()

    def entry(name: str) -> dict:
        return {
            "name": name,
            "model": name,
            "modified_at": modified(name),
            "size": size(name),
            "digest": "",
            "details": details(name),
        }

    @app.get("/api/version")
    async def version():
        return {"version": OLLAMA_VERSION, "mlxserve": __version__}

    def cached_entry(model) -> dict:
        """A hub repository in the hub cache that a request may name (not loaded yet)."""
        stamp = datetime.datetime.fromtimestamp(model.modified, datetime.UTC).isoformat()
        gguf = str(model.path).endswith(".gguf")
        return {
            "name": model.ref,
            "model": model.ref,
            "modified_at": stamp,
            "size": model.size,
            "digest": "",
            "details": {"parent_model": "", "format": "gguf" if gguf else "safetensors", "families": []},
        }

    @app.get("/api/tags", dependencies=[Depends(authorized)])
    async def tags():
        listed = [entry(name) for name in list(supervisor.scheduler.runners)]
        if supervisor.config.pull != "never":
            cached = await run_in_threadpool(hub.cached_models)
            listed += [cached_entry(m) for m in cached if m.ref not in supervisor.scheduler.runners]
        return {"models": listed}

    @app.post("/api/pull", dependencies=[Depends(authorized)])
    async def pull(body: PullRequest, request: Request):
        """Ollama's pull, of a hub repository (``pull = "any"``): NDJSON progress records (status, digest,
        total, completed) as the ollama client and Open WebUI read them, or one record with stream false."""
        job = supervisor.scheduler.api_pull(body.name())
        if not body.stream:
            async for _ in hub.follow(job):
                pass
            return {"status": "success"}
        progress = hub.follow(job)
        first = await anext(progress)  # an error before any record is the HTTP status

        async def lines():
            record = first
            try:
                while record is not None:
                    yield json.dumps(pull_record(record)) + "\n"
                    record = await anext(progress, None)
            except ServiceError as error:
                status, shaped = ollama_error(error)
                await log_refusal(request, status, f"(in the stream) {error.message}")
                yield json.dumps(shaped) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.delete("/api/delete", dependencies=[Depends(authorized)])
    async def delete(body: PullRequest):
        """Remove a hub repository from the hub cache (unloading it first); configured models stay."""
        name = body.name()
        if name in supervisor.config.models:
            raise bad(f"model: {name} is configured (docs/configuration.md), not pulled: remove it from the config")
        ref = hub.parse_ref(name)
        if ref is None:
            raise ServiceError(Code.NOT_FOUND, f"model {name!r} not found", "model")
        await run_in_threadpool(supervisor.scheduler.forget, name)
        await run_in_threadpool(hub.delete, ref)
        return JSONResponse({})

    @app.get("/api/ps", dependencies=[Depends(authorized)])
    async def ps():
        models = []
        for name, runner in list(supervisor.scheduler.runners.items()):
            if runner.pid and runner.info is not None:
                keep = runner.model.keep_alive if runner.keep_alive is None else runner.keep_alive
                until = (
                    datetime.datetime.now(datetime.UTC)
                    + datetime.timedelta(seconds=keep - (time.monotonic() - runner.last_used))
                    if keep and math.isfinite(keep)
                    else datetime.datetime(2318, 1, 1, tzinfo=datetime.UTC)  # Ollama's "forever"
                )
                status = supervisor.status(runner)
                models.append(
                    {
                        **entry(name),
                        "expires_at": until.isoformat(),
                        "size": status.memory.rss or status.memory.estimate,
                        "size_vram": status.memory.mlx_active if runner.info.backend != "cpu" else 0,
                        "context_length": runner.info.target.context_length,
                    }
                )
        return {"models": models}

    @app.post("/api/show", dependencies=[Depends(authorized)])
    async def show(body: dict):
        name = body.get("model") or body.get("name")
        if not isinstance(name, str):
            raise bad("model: required", "model")
        runner = supervisor.scheduler.runner(name)
        info = runner.info
        capabilities = ["completion"]
        if info is not None and info.chat_template:
            capabilities.append("tools")  # a template without tool support gets the generic layout
        if info is not None and info.reasoning_format:
            capabilities.append("thinking")
        if info is not None and info.vision:
            capabilities.append("vision")  # what Ollama's clients look for before they send images
        model_info = {}
        if info is not None:
            model_info = {
                "general.architecture": info.target.architecture,
                "general.parameter_count": info.target.parameters,
                f"{info.target.architecture}.context_length": info.target.context_length,
                "mlxserve.tool_format": info.tool_format,
                "mlxserve.draft": info.draft.path,
            }
        return {
            "modelfile": f"# served by mlxserve from {runner.model.target}\nFROM {runner.model.target}\n",
            "parameters": "\n".join(f"{k} {v}" for k, v in DEFAULTS.items()),
            "template": "",
            "details": details(name),
            "model_info": model_info,
            "capabilities": capabilities,
            "modified_at": modified(name),
        }

    for verb in NOT_HERE:

        @app.api_route(
            f"/api/{verb}" + ("/{rest:path}" if verb == "blobs" else ""), methods=["GET", "POST", "HEAD", "DELETE"]
        )
        async def not_here(request: Request):
            what = request.url.path.split("/")[2]
            why = "this server's models are configured in its TOML config (docs/configuration.md), not pulled"
            raise ServiceError(Code.UNIMPLEMENTED, f"/api/{what} is not supported here: {why}")

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        """What Ollama answers at its root, which its clients and health checks ask (no token needed, as Ollama's)."""
        return PlainTextResponse("Ollama is running")

    async def keep_alive_after(name: str, seconds: float | None) -> None:
        await keep_alive(supervisor, name, seconds)

    async def load_or_unload(request: Request, body, seconds: float | None) -> dict:
        started = time.perf_counter()
        if seconds == 0:
            await run_in_threadpool(supervisor.scheduler.unload, body.model, "keep_alive 0 (Ollama API)")
            reason = "unload"
        else:
            await load_while_connected(request, supervisor.scheduler, body.model, only=True)
            await keep_alive_after(body.model, seconds)
            reason = "load"
        out = {"model": body.model, "created_at": now(), "done": True, "done_reason": reason}
        out["total_duration"] = int((time.perf_counter() - started) * 1e9)
        return out

    @app.post("/api/chat", dependencies=[Depends(authorized)])
    async def chat(body: ChatRequest, request: Request):
        seconds = keep_alive_seconds(body.keep_alive)
        if not body.messages:
            answer = await load_or_unload(request, body, seconds)
            return {**answer, "message": {"role": "assistant", "content": ""}}
        return await generate_answer(request, body, body.to_proto(), seconds, chat=True)

    @app.post("/api/generate", dependencies=[Depends(authorized)])
    async def generate(body: GenerateRequest, request: Request):
        seconds = keep_alive_seconds(body.keep_alive)
        if not body.prompt and not body.system:
            return {**await load_or_unload(request, body, seconds), "response": ""}
        runner = supervisor.scheduler.runner(body.model)
        if runner.info is None and not body.raw:  # whether it has a chat template: load it to know
            await load_while_connected(request, supervisor.scheduler, body.model)
        templated = runner.info is not None and runner.info.chat_template
        return await generate_answer(request, body, body.to_proto(templated), seconds, chat=False)

    async def generate_answer(request: Request, body, proto, seconds: float | None, chat: bool):
        started = time.perf_counter()
        if not supervisor.scheduler.runner(body.model).pid:  # load it first, to tell load_duration apart
            await load_while_connected(request, supervisor.scheduler, body.model)
        load = time.perf_counter() - started
        generation = supervisor.generate(proto, timeout=None)
        key = "message" if chat else "response"

        def piece(text: str, calls=None, thinking: str = "") -> dict:
            if not chat:
                out = {"model": body.model, "created_at": now(), "response": text, "done": False}
                if thinking:
                    out["thinking"] = thinking
                return out
            message = {"role": "assistant", "content": text}
            if thinking:  # a model that thinks apart: its reasoning, as Ollama gives it
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"model": body.model, "created_at": now(), "message": message, "done": False}

        context: list[int] = []  # /api/generate: the prompt's tokens and the answer's, Ollama's context

        def take(chunk) -> None:
            if not chat:
                context.extend(chunk.prompt_ids if not context else ())
                context.extend(chunk.token_ids)

        def final(last, total: float) -> dict:
            out = {**piece(""), "done": True, "done_reason": done_reason(last)}
            if not chat:
                out["context"] = context
            out.update(timings(last.stats, total, load))
            return out

        if not body.stream:
            chunks = await until_done(request, generation, generation.collect)
            await keep_alive_after(body.model, seconds)
            for chunk in chunks:
                take(chunk)
            text = "".join(c.text for c in chunks)
            thinking = "".join(c.reasoning for c in chunks)
            calls = ollama_calls([d for c in chunks for d in c.tool_calls]) if chat else []
            out = final(chunks[-1], time.perf_counter() - started)
            whole = piece(text, calls, thinking)
            out[key] = whole[key]
            if not chat and thinking:
                out["thinking"] = thinking
            return out

        chunks = aiter(generation)
        first = await until_done(request, generation, lambda: anext(chunks, None))

        async def lines():
            chunk, deltas = first, []
            try:
                while chunk is not None:
                    deltas += chunk.tool_calls
                    take(chunk)
                    if chunk.text or chunk.reasoning:
                        yield json.dumps(piece(chunk.text, thinking=chunk.reasoning), ensure_ascii=False) + "\n"
                    if chunk.finish_reason:
                        if deltas and chat:  # calls whole, as Ollama sends them, before the end
                            yield json.dumps(piece("", ollama_calls(deltas)), ensure_ascii=False) + "\n"
                        yield json.dumps(final(chunk, time.perf_counter() - started)) + "\n"
                    chunk = await anext(chunks, None)
            except ServiceError as error:
                status, shaped = ollama_error(error)
                await log_refusal(request, status, f"(in the stream) {error.message}")
                yield json.dumps(shaped) + "\n"
            await keep_alive_after(body.model, seconds)

        return EventStream(lines(), generation, chunks, media_type="application/x-ndjson")


def error_response(error: ServiceError) -> JSONResponse:
    status, body = ollama_error(error)
    return JSONResponse(body, status_code=status)
