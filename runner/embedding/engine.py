"""An embedding or reranking model loaded: its tokenizer, its limits, and a forward pass over a padded batch.

``EmbeddingEngine.load`` reads a folder the way sentence-transformers does: the weights (``model.safetensors``),
``tokenizer.json`` (Hugging Face's tokenizers, padding and truncation its file may set switched off: the engine
pads and cuts itself), ``modules.json`` / ``1_Pooling/config.json`` for the pooling and whether vectors are
normalised, ``sentence_bert_config.json`` for the longest input (all-MiniLM-L6-v2: 256 tokens, though its
positions go to 512) and ``config_sentence_transformers.json`` for the prompts. Tokenizing runs on the calling
thread (the gRPC handler's), so requests tokenize in parallel while the MLX thread runs batches.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.embedding import ENCODER_TYPES, SentenceConfig, check_embed, check_rerank, model_kind
from common.errors import InvalidRequest, ModelLoadError

from .model import load_encoder

log = logging.getLogger("runner")


@dataclass
class Row:
    """One input as the MLX thread runs it: its token ids, and the segment of each (a pair's second text: 1)."""

    ids: list[int]
    types: list[int] | None = None


class EmbeddingEngine:
    def __init__(self, folder: Path, settings, kind: str, model, tokenizer, config: dict, sentence: SentenceConfig):
        self.folder, self.settings, self.kind = folder, settings, kind
        self.model, self.config, self.sentence = model, config, sentence
        self.decoder = config.get("model_type") not in ENCODER_TYPES
        self.tokenizer = tokenizer
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        positions = int(config.get("max_position_embeddings") or 0) or 512
        limit = sentence.max_seq_length or positions
        if settings.max_context:
            limit = min(limit, settings.max_context)
        self.context_length = min(limit, positions)
        self.vocab_size = int(config.get("vocab_size") or tokenizer.get_vocab_size())
        self.dimensions = int(config.get("hidden_size") or 0)
        self.matryoshka = tuple(n for n in settings.matryoshka_dimensions if n < self.dimensions)
        self.parameters = sum(v.size for _, v in _leaves(model.parameters()))
        self.dtype = str(next(v for _, v in _leaves(model.parameters())).dtype).removeprefix("mlx.core.")
        self.pad_id = int(config.get("pad_token_id") or 0) if config.get("pad_token_id") is not None else 0
        self.heads = int(config.get("num_attention_heads") or 1)
        # The token the tokenizer closes a sequence with (BERT's [SEP], Qwen3-Embedding's <|endoftext|>): kept
        # at the end of a truncated input.
        plain, full = tokenizer.encode("a", add_special_tokens=False).ids, tokenizer.encode("a").ids
        self.closing = full[-1] if full and (not plain or full[-1] != plain[-1]) else None

    # -- loading ------------------------------------------------------------------------------------------------

    @classmethod
    def load(cls, folder, settings) -> EmbeddingEngine:
        from tokenizers import Tokenizer

        folder = Path(folder)
        kind = model_kind(folder, settings.kind)
        try:
            config = json.loads((folder / "config.json").read_text())
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except (OSError, ValueError, Exception) as error:  # tokenizers raises its own Exception
            raise ModelLoadError(folder, f"config.json or tokenizer.json cannot be read: {error}") from None
        encoder = config.get("model_type") in ENCODER_TYPES
        sentence = SentenceConfig.of(folder, decoder=not encoder)
        try:
            if encoder:
                files = sorted(folder.glob("model*.safetensors"))
                if not files:
                    raise ModelLoadError(folder, "no model*.safetensors")
                weights = {}
                for file in files:
                    weights.update(mx.load(str(file)))
                model = load_encoder(config, weights, rerank=kind == "rerank")
            else:
                if kind == "rerank":
                    raise ModelLoadError(folder, f"a {config.get('model_type')} reranker is not served yet")
                model = load_decoder(folder)
        except ValueError as error:
            raise ModelLoadError(folder, str(error)) from None
        if settings.dtype != "checkpoint" or mx.default_device() == mx.cpu:
            model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        return cls(folder, settings, kind, model, tokenizer, config, sentence)

    # -- requests (on the caller's thread) -----------------------------------------------------------------------

    def embed_rows(self, texts, token_ids, truncate: bool, dimensions: int, prompt_name: str) -> tuple[list, int]:
        """The rows of an Embed request, checked; and how many inputs were cut to the model's length. An input
        past it is refused (InvalidRequest naming the input) unless ``truncate``."""
        prompts = self.sentence.prompts
        check_embed(texts, token_ids, dimensions, self.dimensions, self.matryoshka, prompt_name, prompts)
        limit, truncated = self.context_length, 0
        if token_ids:
            rows = []
            for i, ids in enumerate(token_ids):
                bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
                if bad is not None:
                    raise InvalidRequest(
                        "input", f"input {i}: token id {bad} is not in the vocabulary [0, {self.vocab_size})"
                    )
                if len(ids) > limit:
                    if not truncate:
                        raise self._too_long(i, len(ids))
                    ids, truncated = ids[:limit], truncated + 1
                rows.append(Row(list(ids)))
            return rows, truncated
        prefix = prompts.get(prompt_name or self.sentence.default_prompt_name, "")
        encoded = self.tokenizer.encode_batch([prefix + t for t in texts])
        rows = []
        for i, e in enumerate(encoded):
            ids = e.ids
            if len(ids) > limit:
                if not truncate:
                    raise self._too_long(i, len(ids))
                ids, truncated = self._cut(ids), truncated + 1
            rows.append(Row(ids))
        return rows, truncated

    def rerank_rows(self, query: str, documents, truncate: bool) -> tuple[list, int]:
        check_rerank(query, documents)
        limit, truncated, rows = self.context_length, 0, []
        for i, e in enumerate(self.tokenizer.encode_batch([(query, d) for d in documents])):
            ids, types = e.ids, e.type_ids
            if len(ids) > limit:
                if not truncate:
                    raise InvalidRequest(
                        "documents",
                        f"document {i} with the query is {len(ids)} tokens, over the model's {limit} "
                        "(set truncate to cut it)",
                    )
                first = types.index(1) if 1 in types else len(ids)
                if first >= limit - 1:
                    raise InvalidRequest("query", f"the query alone is {first} tokens, over the model's {limit}")
                ids, types = ids[: limit - 1] + ids[-1:], types[: limit - 1] + types[-1:]  # keep the closing [SEP]
                truncated += 1
            rows.append(Row(ids, types))
        return rows, truncated

    def _cut(self, ids: list[int]) -> list[int]:
        """The first tokens that fit, with the sequence's closing special token kept (BERT's [SEP], a decoder
        embedding model's end-of-text), as sentence-transformers' truncation leaves it."""
        limit = self.context_length
        if self.closing is not None and ids[-1] == self.closing:
            return ids[: limit - 1] + [self.closing]
        return ids[:limit]

    def _too_long(self, index: int, tokens: int) -> InvalidRequest:
        return InvalidRequest(
            "input",
            f"input {index} is {tokens} tokens, over the model's {self.context_length} (set truncate to cut it)",
        )

    # -- forward passes (on the MLX thread) ----------------------------------------------------------------------

    def run(self, rows: list[Row]) -> np.ndarray:
        """One padded batch: pooled vectors (rows x dimensions, float32, normalised when the model says so), or a
        reranker's scores (rows,), in [0, 1]."""
        width = max(len(r.ids) for r in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        types = np.zeros((len(rows), width), dtype=np.int32)
        lengths = np.array([len(r.ids) for r in rows], dtype=np.int32)
        for i, r in enumerate(rows):
            ids[i, : len(r.ids)] = r.ids
            if r.types is not None:
                types[i, : len(r.types)] = r.types
        ids, types, lengths_mx = mx.array(ids), mx.array(types), mx.array(lengths)
        if self.kind == "rerank":
            out = mx.sigmoid(self.model(ids, types, lengths_mx).astype(mx.float32))
        else:
            states = self.model(ids, types, lengths_mx) if not self.decoder else self.model.model(ids)
            out = pool(states.astype(mx.float32), lengths_mx, self.sentence.pooling)
            if self.sentence.normalize:
                out = out / mx.maximum(mx.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        mx.eval(out)
        return np.array(out)

    def batch_width(self, longest: int) -> int:
        """Rows of ``longest`` tokens one forward pass takes: ``embed_batch``, fewer where the attention scores
        (rows x heads x tokens^2 in float32) would pass the prefill score budget."""
        budget = self.settings.prefill_score_bytes
        return max(1, min(self.settings.embed_batch, budget // max(1, self.heads * longest * longest * 4)))


def pool(states: mx.array, lengths: mx.array, mode: str) -> mx.array:
    """(batch, tokens, hidden) -> (batch, hidden) over each row's real tokens."""
    real = (mx.arange(states.shape[1])[None] < lengths[:, None])[..., None]
    if mode == "cls":
        return states[:, 0]
    if mode == "last":
        return mx.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.max(mx.where(real, states, -1e9), axis=1)
    return mx.sum(mx.where(real, states, 0.0), axis=1) / mx.maximum(lengths[:, None].astype(states.dtype), 1)


def load_decoder(folder: Path):
    """A decoder embedding model (Qwen3-Embedding): mlx-lm's model class, its weights with or without the
    ``model.`` prefix (Qwen3-Embedding saves its Qwen3Model's without it; there is no head to load)."""
    from mlx_lm.utils import load_config, load_model

    config = load_config(folder)
    weights = {}
    for file in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(file)))
    if weights and not any(k.startswith("model.") for k in weights):
        from mlx_lm.utils import _get_classes

        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
        prefixed = [("model." + k, v) for k, v in weights.items()]
        model.load_weights(prefixed, strict=False)
        missing = {k for k, _ in _leaves(model.model.parameters())} - {k[6:] for k, _ in prefixed}
        if missing:
            raise ValueError(f"weights missing: {', '.join(sorted(missing)[:5])}")
        return model
    model, _ = load_model(folder, strict=False)
    return model


def _leaves(tree, prefix: str = ""):
    """(name, array) of every parameter in an mlx parameter tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _leaves(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree
