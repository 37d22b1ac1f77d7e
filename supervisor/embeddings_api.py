"""Embeddings and rerank over HTTP: OpenAI's, Ollama's and the rerank shape llama.cpp and vLLM serve.

    POST /v1/embeddings          OpenAI: input (a string, strings, token ids, lists of token ids), encoding_format
                                 (float or base64), dimensions, user; answers data[] and usage
    POST /api/embed              Ollama: input (one or many), truncate (default true), dimensions, keep_alive
    POST /api/embeddings         Ollama's older one: prompt -> embedding
    POST /v1/rerank, /rerank     Jina's and Cohere's shape (as llama.cpp and vLLM serve it): query, documents
                                 (strings or {"text": ...}), top_n, return_documents; answers results[] with index
                                 and relevance_score, best first

Each takes the path of ``supervisor.embeddings``. Bodies are read as JSON and checked here field by field, so a
wrong type is a 400 naming the field, in the API's error shape (OpenAI's; Ollama's under /api/); a field the
server cannot honour (an Ollama option, OpenAI's encoding_format other than float or base64) is refused, never
ignored. An input longer than the model takes is refused under OpenAI's API (as OpenAI does) and cut under
Ollama's unless ``truncate`` is false (as Ollama does); /v1/rerank cuts the document (as llama.cpp does) unless
``truncate`` is false.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
import time

import numpy as np
from fastapi import Depends, FastAPI, Request
from starlette.concurrency import run_in_threadpool

from common.requests import is_unicode
from common.status import Code, ServiceError

from . import embeddings
from .http_common import load_while_connected, while_connected
from .protocol import supervisor_pb2

TOKEN_ID_LIMIT = 2**31  # what a token id field holds; the runner checks the model's vocabulary


def bad(message: str, param: str | None = None) -> ServiceError:
    return ServiceError(Code.INVALID_ARGUMENT, message, param)


async def json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError):
        raise bad("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def text(value, where: str) -> str:
    if not isinstance(value, str):
        raise bad(f"{where}: must be a string, not {type(value).__name__}", where.split(".")[0].split("[")[0])
    if not is_unicode(value):
        raise bad(f"{where}: not valid Unicode (a lone surrogate)", where.split(".")[0].split("[")[0])
    return value


def is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(ids: list, where: str) -> list[int]:
    for t in ids:
        if not is_id(t):
            raise bad(f"{where}: a token id must be an integer, not {type(t).__name__}", "input")
        if not 0 <= t < TOKEN_ID_LIMIT:
            raise bad(f"{where}: token id {t} is not in the vocabulary", "input")
    return ids


def inputs(value, field: str, allow_ids: bool) -> tuple[list[str], list[list[int]]]:
    """(texts, token id lists) of an ``input``: a string, a list of strings, or (OpenAI) a list of token ids or
    a list of such lists."""
    if isinstance(value, str):
        return [text(value, field)], []
    if not isinstance(value, list):
        kinds = "a string, a list of strings" + (", token ids or lists of token ids" if allow_ids else "")
        raise bad(f"{field}: must be {kinds}, not {type(value).__name__ if value is not None else 'missing'}", field)
    if not value:
        raise bad(f"{field}: no input to embed: give a string or a non-empty list", field)
    if len(value) > embeddings.MAX_INPUTS:
        raise bad(f"{field}: {len(value)} inputs: at most {embeddings.MAX_INPUTS} in one request", field)
    if allow_ids and all(is_id(v) for v in value):
        return [], [token_ids(value, field)]
    if allow_ids and all(isinstance(v, list) for v in value):
        return [], [token_ids(v, f"{field}[{i}]") for i, v in enumerate(value)]
    return [text(v, f"{field}[{i}]") for i, v in enumerate(value)], []


def whole_number(body: dict, key: str, low: int = 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_id(value) or value < low or value >= 2**31:
        raise bad(f"{key}: must be a whole number of at least {low}", key)
    return value


def boolean(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{key}: must be true or false", key)
    return value


def model_name(body: dict) -> str:
    value = body.get("model", "")
    return text(value, "model") if value is not None else ""


def build_embed(model: str, texts, ids, truncate: bool, dimensions: int | None, request_id: str = ""):
    message = supervisor_pb2.EmbedRequest(
        model=model, texts=texts, truncate=truncate, dimensions=dimensions or 0, request_id=request_id
    )
    for row in ids:
        message.token_ids.add(ids=row)
    return message


def register(app: FastAPI, supervisor, authorized) -> None:
    from .http_common import REQUEST_ID
    from .ollama_api import keep_alive as ollama_keep_alive
    from .ollama_api import keep_alive_seconds

    # -- OpenAI ---------------------------------------------------------------------------------------------

    @app.post("/v1/embeddings", dependencies=[Depends(authorized)])
    async def openai_embeddings(request: Request):
        body = await json_body(request)
        model = model_name(body)
        texts, ids = inputs(body.get("input"), "input", allow_ids=True)
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise bad(f"encoding_format: {encoding!r} is not one of float, base64", "encoding_format")
        if body.get("user") is not None:
            text(body["user"], "user")
        dimensions = whole_number(body, "dimensions")
        message = build_embed(model, texts, ids, False, dimensions, REQUEST_ID.get())
        answer = await while_connected(request, embeddings.embed(supervisor, message))
        data = []
        for i, e in enumerate(answer.embeddings):
            vector = np.asarray(e.values, dtype="<f4")
            value = base64.b64encode(vector.tobytes()).decode() if encoding == "base64" else vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
        usage = {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens}
        return {"object": "list", "data": data, "model": model, "usage": usage}

    # -- Ollama ---------------------------------------------------------------------------------------------

    def ollama_options(body: dict) -> None:
        options = body.get("options")
        if options is None:
            return
        if not isinstance(options, dict):
            raise bad("options: must be an object", "options")
        for key in options:
            raise bad(f"options.{key}: not taken by an embedding model here", "options")

    async def keep_alive(model: str, seconds: float | None) -> None:
        await ollama_keep_alive(supervisor, model, seconds)

    @app.post("/api/embed", dependencies=[Depends(authorized)])
    async def ollama_embed(request: Request):
        started = time.perf_counter()
        body = await json_body(request)
        model = model_name(body)
        seconds = keep_alive_seconds(body.get("keep_alive"))
        ollama_options(body)
        truncate = boolean(body, "truncate", True)
        dimensions = whole_number(body, "dimensions")
        value = body.get("input")
        if value in (None, "", []):  # as Ollama: nothing to embed loads the model (or keep_alive 0 unloads it)
            if seconds == 0:
                await run_in_threadpool(supervisor.scheduler.unload, model, "keep_alive 0 (Ollama API)")
            else:
                await load_while_connected(request, supervisor.scheduler, model, only=True)
                await keep_alive(model, seconds)
            return {"model": model, "embeddings": []}
        texts, _ = inputs(value, "input", allow_ids=False)
        message = build_embed(model, texts, [], truncate, dimensions, REQUEST_ID.get())
        answer = await while_connected(request, embeddings.embed(supervisor, message))
        await keep_alive(model, seconds)
        total = int((time.perf_counter() - started) * 1e9)
        return {
            "model": model,
            "embeddings": [list(e.values) for e in answer.embeddings],
            "total_duration": total,
            "load_duration": 0,
            "prompt_eval_count": answer.prompt_tokens,
        }

    @app.post("/api/embeddings", dependencies=[Depends(authorized)])
    async def ollama_embeddings(request: Request):
        body = await json_body(request)
        model = model_name(body)
        seconds = keep_alive_seconds(body.get("keep_alive"))
        ollama_options(body)
        prompt = body.get("prompt")
        if prompt in (None, ""):  # as Ollama: an empty embedding
            await load_while_connected(request, supervisor.scheduler, model, only=True)
            return {"embedding": []}
        message = build_embed(model, [text(prompt, "prompt")], [], True, None, REQUEST_ID.get())
        answer = await while_connected(request, embeddings.embed(supervisor, message))
        await keep_alive(model, seconds)
        return {"embedding": list(answer.embeddings[0].values)}

    # -- rerank ---------------------------------------------------------------------------------------------

    async def rerank(request: Request):
        body = await json_body(request)
        model = model_name(body)
        query = text(body.get("query"), "query")
        documents = body.get("documents")
        if not isinstance(documents, list):
            raise bad('documents: must be a list of strings or of {"text": ...} objects', "documents")
        texts = []
        for i, d in enumerate(documents):
            if isinstance(d, dict):
                if set(d) - {"text"}:
                    raise bad(f"documents[{i}]: a document object has only text", "documents")
                d = d.get("text")
            texts.append(text(d, f"documents[{i}]"))
        top_n = whole_number(body, "top_n", low=0)
        returned = boolean(body, "return_documents", True)
        truncate = boolean(body, "truncate", True)
        for key in ("rank_fields", "max_chunks_per_doc"):
            if body.get(key) is not None:
                raise bad(f"{key}: not served (documents are plain texts, scored whole)", key)
        if not texts:
            raise bad("documents: no documents to rank: give a non-empty list", "documents")
        message = supervisor_pb2.RerankRequest(
            model=model, query=query, documents=texts, truncate=truncate, request_id=REQUEST_ID.get()
        )
        answer = await while_connected(request, embeddings.rerank(supervisor, message))
        order = sorted(range(len(texts)), key=lambda i: -answer.scores[i])
        if top_n:
            order = order[:top_n]
        results = []
        for i in order:
            score = float(answer.scores[i])
            entry = {"index": i, "relevance_score": score if math.isfinite(score) else 0.0}
            if returned:
                entry["document"] = {"text": texts[i]}
            results.append(entry)
        return {
            "id": f"rerank-{secrets.token_hex(8)}",
            "model": model,
            "results": results,
            "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
        }

    for path in ("/v1/rerank", "/rerank"):
        app.post(path, dependencies=[Depends(authorized)])(rerank)
