"""Embedding and reranking models, as both processes see them: what a model folder is, how a sentence-transformers
folder says it pools and prompts, and the limits and checks of an Embed or Rerank request. Importable without MLX
(the supervisor reads a folder's kind for its memory estimate; the runner loads the model, runner/embedding).

A folder's kind (``model_kind``):

- ``rerank``: a cross-encoder, ``*ForSequenceClassification`` in its config's architectures (bge-reranker,
  ms-marco MiniLM); one logit per (query, document) pair, through a sigmoid.
- ``embed``: a sentence-transformers folder (``modules.json`` with a Pooling module), or an encoder by its
  architecture (``BertModel``, ``XLMRobertaModel``, ...) or model type; decoder embedding models (Qwen3-Embedding)
  ship a ``modules.json`` with last-token pooling.
- ``generate``: everything else (mlx-lm's models, GGUF imports, models that see).

The ``kind`` setting overrides it (a Qwen3-Reranker is a Qwen3ForCausalLM whose "yes"/"no" logits score a pair:
``kind = "rerank"``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InvalidRequest

KINDS = ("generate", "embed", "rerank")
# Inputs one request may hold: OpenAI's limit for /v1/embeddings (2,048), for every API here.
MAX_INPUTS = 2048
# Characters all of one request's texts may have together: past it the request is refused before any is
# tokenized (a gRPC message is 8 MiB at most; a 512-token model reads a few thousand characters of each).
MAX_TOTAL_CHARS = 1_800_000
ENCODER_ARCHITECTURES = {
    "BertModel",
    "BertForMaskedLM",
    "XLMRobertaModel",
    "RobertaModel",
    "NomicBertModel",
    "DistilBertModel",
}
ENCODER_TYPES = {"bert", "xlm-roberta", "roberta", "nomic_bert", "distilbert"}
POOLING_MODES = ("mean", "cls", "last", "max")


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _modules(folder: Path) -> list[dict]:
    try:
        value = json.loads((folder / "modules.json").read_text())
    except (OSError, ValueError):
        return []
    return [m for m in value if isinstance(m, dict)] if isinstance(value, list) else []


def model_kind(folder, setting: str = "auto") -> str:
    """``generate``, ``embed`` or ``rerank`` for a model folder (see the module's text); ``setting`` when not auto."""
    if setting in KINDS:
        return setting
    folder = Path(folder)
    if not folder.is_dir():
        return "generate"  # a .gguf file, a hub reference still to resolve
    config = _json(folder / "config.json")
    architectures = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "rerank"
    if any(str(m.get("type", "")).endswith(".Pooling") for m in _modules(folder)):
        return "embed"
    if any(a in ENCODER_ARCHITECTURES for a in architectures):
        return "embed"
    if not architectures and config.get("model_type") in ENCODER_TYPES:
        return "embed"
    return "generate"


@dataclass(frozen=True)
class SentenceConfig:
    """What a sentence-transformers folder says about its vectors (defaults: a plain encoder, mean-pooled)."""

    pooling: str = "mean"  # mean, cls, last or max
    normalize: bool = False
    max_seq_length: int = 0  # 0: the model's positions
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str = ""
    include_prompt: bool = True  # the prompt's tokens are pooled with the text's

    @classmethod
    def of(cls, folder, decoder: bool = False) -> SentenceConfig:
        folder = Path(folder)
        modules = _modules(folder)
        pooling = "last" if decoder else "mean"
        include_prompt = True
        for module in modules:
            if str(module.get("type", "")).endswith(".Pooling"):
                pooled = _json(folder / str(module.get("path", "")) / "config.json")
                mode = pooled.get("pooling_mode")
                if isinstance(mode, str) and mode:
                    pooling = {"lasttoken": "last", "mean_tokens": "mean"}.get(mode, mode)
                else:
                    for key, name in (
                        ("pooling_mode_cls_token", "cls"),
                        ("pooling_mode_lasttoken", "last"),
                        ("pooling_mode_max_tokens", "max"),
                        ("pooling_mode_mean_tokens", "mean"),
                    ):
                        if pooled.get(key):
                            pooling = name
                            break
                include_prompt = bool(pooled.get("include_prompt", True))
        normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        bert = _json(folder / "sentence_bert_config.json")
        st = _json(folder / "config_sentence_transformers.json")
        prompts = {k: v for k, v in (st.get("prompts") or {}).items() if isinstance(k, str) and isinstance(v, str)}
        return cls(
            pooling=pooling if pooling in POOLING_MODES else "mean",
            normalize=normalize,
            max_seq_length=int(bert.get("max_seq_length") or 0),
            prompts=prompts,
            default_prompt_name=str(st.get("default_prompt_name") or ""),
            include_prompt=include_prompt,
        )


def check_embed(texts, token_ids, dimensions: int, native: int, matryoshka, prompt_name: str, prompts) -> None:
    """An Embed request's fields against the model (``native`` dimensions, its ``matryoshka`` sizes and
    ``prompts``); raises InvalidRequest naming the field. Token ids are checked against the vocabulary by the
    runner, which knows it."""
    if texts and token_ids:
        raise InvalidRequest("input", "give texts or token ids, not both")
    count = len(texts) or len(token_ids)
    if count == 0:
        raise InvalidRequest("input", "no input to embed: give a string or a non-empty list")
    if count > MAX_INPUTS:
        raise InvalidRequest("input", f"{count} inputs: at most {MAX_INPUTS} in one request")
    characters = sum(map(len, texts))
    if characters > MAX_TOTAL_CHARS:
        raise InvalidRequest("input", f"{characters} characters: at most {MAX_TOTAL_CHARS} in one request")
    for i, ids in enumerate(token_ids):
        if not ids:
            raise InvalidRequest("input", f"input {i} has no tokens")
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest("input", f"input {i} is empty")
    if dimensions < 0:
        raise InvalidRequest("dimensions", "must be a positive number")
    if dimensions and dimensions != native and dimensions not in matryoshka:
        if not matryoshka:
            raise InvalidRequest(
                "dimensions", f"the model's vectors have {native} dimensions and it was not trained to be cut shorter"
            )
        sizes = ", ".join(map(str, sorted({*matryoshka, native})))
        raise InvalidRequest("dimensions", f"{dimensions} is not a size the model was trained for ({sizes})")
    if prompt_name and prompt_name not in prompts:
        named = ", ".join(sorted(prompts)) or "none"
        raise InvalidRequest("prompt_name", f"{prompt_name!r} is not one of the model's prompts ({named})")


def check_rerank(query: str, documents) -> None:
    if not query:
        raise InvalidRequest("query", "must be a non-empty string")
    if not documents:
        raise InvalidRequest("documents", "no documents to rank: give a non-empty list")
    if len(documents) > MAX_INPUTS:
        raise InvalidRequest("documents", f"{len(documents)} documents: at most {MAX_INPUTS} in one request")
    characters = len(query) + sum(map(len, documents))
    if characters > MAX_TOTAL_CHARS:
        raise InvalidRequest("documents", f"{characters} characters: at most {MAX_TOTAL_CHARS} in one request")
    for i, text in enumerate(documents):
        if not text:
            raise InvalidRequest("documents", f"document {i} is empty")


def not_this_kind(model: str, kind: str, asked: str) -> InvalidRequest:
    """The refusal for a request of the wrong kind: ``asked`` is what the request wanted (embeddings, a ranking,
    a generation)."""
    what = {"generate": "generates text", "embed": "is an embedding model", "rerank": "is a reranking model"}[kind]
    serves = {"generate": "chat and completions", "embed": "embeddings", "rerank": "rerank"}[kind]
    return InvalidRequest("model", f"model {model} {what}: it serves {serves}, not {asked}")
