"""Block drafting (``drafter = "block"``): a drafter that proposes a block of tokens in one forward pass.

DFlash's idea (z-lab/dflash, "Block Diffusion for Flash Speculative Decoding"), in its published checkpoint
layout, which this module loads as it is and which models/train_block.py writes for the drafters trained here:

- ``config.json``: a Qwen3-style decoder config (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``,
  ``rope_scaling``, ``attention_bias``, ``vocab_size``), ``architectures: ["DFlashDraftModel"]``, ``block_size``
  and ``dflash_config: {"mask_token_id", "target_layer_ids"}`` (optional ``is_causal``, ``layer_types``);
- ``model.safetensors``: ``fc`` (the concatenated target hidden states -> width), ``hidden_norm``,
  ``layers.N.{self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, mlp.{gate,up,down}_proj, input_layernorm,
  post_attention_layernorm}`` and ``norm``. No embedding and no LM head: the target's are used.

How it drafts. The target's hidden states after the layers ``target_layer_ids`` (Hugging Face's
``hidden_states[i + 1]``, so the last layer's is after the final norm) are concatenated per position, projected by
``fc`` and normalised: the context. Each drafter layer attends, without a causal mask, over the context's keys and
values (its own projections of that one context, not propagated through the layers) and the block's: the pending
token's embedding followed by ``block_size - 1`` embeddings of ``mask_token_id``. One pass gives logits at the
``block_size - 1`` mask positions: the drafts. The full block always runs, so a draft of depth k costs the same
one pass for every k up to ``block_size - 1`` (and the drafts do not depend on k).

Its cache holds the context's keys and values of every position the target kept (roped at their own positions);
the block's are never stored, so a rejected draft needs no rewinding. The hidden states come from ``TappedModel``,
the target as a block request calls it: its tapped layers write their outputs while it runs (``install_taps``
gives those layers a subclass that does; nothing is written outside such a call). Positions the target ran
without it (a prompt-cache hit's prefix, batched rounds) are missing from the context: the drafter drafts from
what it saw and verification stays the target's.

Drafters trained here add ``dflash_config.target``: the identity of the target they were trained on (its config
and weights' sizes); a block folder trained for another target is refused with the reason. A public checkpoint
without it is checked by shape (width, vocabulary, tapped layers).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3 import MLP
from mlx_lm.models.rope_utils import initialize_rope

from ..sampling import SamplingParams
from .drafters import HiddenStateDrafter, Proposal, draft_token, to_full_vocabulary
from .mtp import _offset, _text_model, lm_head

ARCHITECTURE = "DFlashDraftModel"


class BlockError(ValueError):
    """Why a block drafter folder cannot serve this target."""


@dataclass
class BlockConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    rope_scaling: dict | None = None
    attention_bias: bool = False
    is_causal: bool = False
    target: str | None = None  # the identity of the target it was trained on (ours); None in public checkpoints
    draft_vocab_size: int = 0  # ours: drafts only from these many of the target's tokens (``draft_vocab``); 0 = all
    normalize_taps: bool = False  # ours: each tapped layer's hidden state RMS-normalised before ``fc``

    @classmethod
    def from_dict(cls, config: dict) -> BlockConfig:
        if ARCHITECTURE not in (config.get("architectures") or []):
            raise BlockError(f"not a DFlash drafter (architectures {config.get('architectures')})")
        dflash = config.get("dflash_config") or {}
        layer_types = set(config.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise BlockError(f"layer types {sorted(layer_types)}: only full attention is read")
        heads = int(config["num_attention_heads"])
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
            block_size=int(dflash.get("block_size", config.get("block_size", 16))),
            target_layer_ids=tuple(int(i) for i in dflash.get("target_layer_ids", config.get("target_layer_ids"))),
            mask_token_id=int(dflash.get("mask_token_id", config.get("mask_token_id", 0))),
            rope_scaling=config.get("rope_scaling"),
            attention_bias=bool(config.get("attention_bias", False)),
            is_causal=bool(dflash.get("is_causal", config.get("is_causal")) or False),
            target=dflash.get("target"),
            draft_vocab_size=int(dflash.get("draft_vocab_size", 0)),
            normalize_taps=bool(dflash.get("normalize_taps", False)),
        )


class BlockAttention(nn.Module):
    def __init__(self, config: BlockConfig):
        super().__init__()
        width, heads, kv, dim = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.heads, self.kv_heads, self.scale, self.causal = heads, kv, dim**-0.5, config.is_causal
        bias = config.attention_bias
        self.q_proj = nn.Linear(width, heads * dim, bias=bias)
        self.k_proj = nn.Linear(width, kv * dim, bias=bias)
        self.v_proj = nn.Linear(width, kv * dim, bias=bias)
        self.o_proj = nn.Linear(heads * dim, width, bias=bias)
        self.q_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)

    def keys_values(self, x, rope, offset):
        """Roped keys and values (B, kv_heads, L, dim) of ``x`` at positions ``offset``.. (an int or one per row)."""
        B, L, _ = x.shape
        keys = self.k_norm(self.k_proj(x).reshape(B, L, self.kv_heads, -1)).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(B, L, self.kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(keys, offset=offset), values

    def __call__(self, x, rope, offset, context: tuple, mask=None):
        """The block ``x`` (B, L, width) at ``offset`` over ``context`` (keys, values) and itself. ``mask``:
        (B, 1, L, context + L) booleans, or None (all visible, or causal within the block if the config says)."""
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.heads, -1)).transpose(0, 2, 1, 3)
        queries = rope(queries, offset=offset)
        keys, values = self.keys_values(x, rope, offset)
        ctx_keys, ctx_values = context
        if ctx_keys is not None:
            if ctx_keys.shape[0] != B:
                ctx_keys = mx.broadcast_to(ctx_keys, (B, *ctx_keys.shape[1:]))
                ctx_values = mx.broadcast_to(ctx_values, (B, *ctx_values.shape[1:]))
            keys = mx.concatenate([ctx_keys, keys], axis=2)
            values = mx.concatenate([ctx_values, values], axis=2)
        if self.causal:
            seen = keys.shape[2] - L
            causal = mx.arange(seen + L)[None] <= (seen + mx.arange(L))[:, None]
            mask = causal if mask is None else mask & causal
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class BlockLayer(nn.Module):
    def __init__(self, config: BlockConfig):
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def __call__(self, x, rope, offset, context, mask=None):
        h = x + self.self_attn(self.input_layernorm(x), rope, offset, context, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class BlockDraftModel(nn.Module):
    """The drafter's own weights (``fc``, ``hidden_norm``, ``layers``, ``norm``), as the checkpoint names them."""

    def __init__(self, config: BlockConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [BlockLayer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.draft_vocab_size:  # the token ids it drafts from, sorted (EAGLE-3's d2t, as ids)
            self.draft_vocab = mx.zeros((config.draft_vocab_size,), dtype=mx.int32)
        self._rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def context(self, features, offset):
        """Per layer, the (keys, values) of the target's ``features`` (B, L, taps * width) at ``offset``."""
        if self.config.normalize_taps:  # a real model's early layers carry outlier channels that swamp ``fc``
            parts = mx.split(features, len(self.config.target_layer_ids), axis=-1)
            features = mx.concatenate([mx.fast.rms_norm(p, None, self.config.rms_norm_eps) for p in parts], axis=-1)
        x = self.hidden_norm(self.fc(features))
        return [layer.self_attn.keys_values(x, self._rope, offset) for layer in self.layers]

    def __call__(self, block, offset, contexts: list, mask=None):
        """The block's embeddings (B, L, width) at ``offset`` over each layer's context: its last hidden states
        (after the norm), for the LM head."""
        h = block
        for layer, context in zip(self.layers, contexts):
            h = layer(h, self._rope, offset, context, mask)
        return self.norm(h)


def target_identity(folder: Path) -> str:
    """What a drafter trained here records of its target: its config.json and weights' sizes, hashed."""
    folder = Path(folder)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("model*.safetensors")):
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def check(config: BlockConfig, target) -> None:
    """A BlockError naming why ``config``'s drafter cannot serve ``target`` (a runner.loading.load.LoadedModel)."""
    args = _text_model(target.model).args
    if config.target is not None and config.target != target_identity(target.path):
        raise BlockError(
            f"trained for another target (its target {config.target}, {target.path.name} is "
            f"{target_identity(target.path)})"
        )
    if config.hidden_size != args.hidden_size:
        raise BlockError(f"width {config.hidden_size}, {target.path.name}'s is {args.hidden_size}")
    layers = int(args.num_hidden_layers)
    if not config.target_layer_ids or max(config.target_layer_ids) >= layers or min(config.target_layer_ids) < 0:
        raise BlockError(f"taps layers {list(config.target_layer_ids)}; {target.path.name} has {layers}")
    vocab = _text_model(target.model).model.embed_tokens.weight.shape[0]
    if config.mask_token_id >= vocab:
        raise BlockError(f"mask token {config.mask_token_id} is past {target.path.name}'s vocabulary ({vocab})")
    if config.block_size < 2:
        raise BlockError(f"block size {config.block_size}: no drafts")


def load_block(folder, target) -> BlockDraftModel:
    """The block drafter in ``folder`` for ``target`` (a LoadedModel), in the target's compute dtype; a BlockError
    saying why not."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise BlockError(f"{folder} has no config.json")
    config = BlockConfig.from_dict(json.loads((folder / "config.json").read_text()))
    check(config, target)
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    weights = {k: v for k, v in weights.items() if not k.startswith(("embed_tokens.", "lm_head."))}
    model = BlockDraftModel(config)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as error:
        raise BlockError(f"{folder}: {error}") from None
    text = _text_model(target.model)
    vocab = text.model.embed_tokens.weight.shape[0]
    if config.draft_vocab_size and int(model.draft_vocab.max()) >= vocab:
        raise BlockError(f"its draft vocabulary reaches past {target.path.name}'s ({vocab} tokens)")
    model.set_dtype(mx.float32 if target.dtype == "float32" else text.model.embed_tokens.weight.dtype)
    mx.eval(model.parameters())
    return model


def rows_head(model, ids: mx.array):
    """The target's LM head over the tokens ``ids`` only (a linear map to len(ids) logits)."""
    text = _text_model(model)
    head = lm_head(model)
    if getattr(head, "__self__", None) is text.model.embed_tokens:  # tied: the embedding's rows
        rows = text.model.embed_tokens(ids)
    elif hasattr(head, "scales"):  # a quantized head: its rows dequantized
        rows = mx.dequantize(
            head.weight[ids], head.scales[ids], head.biases[ids], group_size=head.group_size, bits=head.bits
        )
    else:
        rows = head.weight[ids]
    mx.eval(rows)
    return lambda hidden: hidden @ rows.T


# -- the target's hidden states ----------------------------------------------------------------------------------


class Taps:
    """Where the tapped layers write while a ``TappedModel`` call runs (``hidden`` is None otherwise)."""

    def __init__(self, layer_ids: tuple[int, ...], last: int, norm):
        self.layer_ids = layer_ids
        self.last = last  # the target's last layer: its tap is read after the final norm (Hugging Face's)
        self.norm = norm
        self.hidden: dict[int, mx.array] | None = None

    def features(self) -> mx.array:
        parts = [self.norm(self.hidden[i]) if i == self.last else self.hidden[i] for i in self.layer_ids]
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


class _Tapped:
    """A layer whose output is also written to its ``Taps`` (names and weights unchanged)."""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)
        taps = self._taps
        if taps.hidden is not None:
            taps.hidden[self._tap_index] = out[0] if isinstance(out, tuple) else out
        return out


_TAPPED: dict[type, type] = {}


def install_taps(model, layer_ids) -> Taps:
    """Tap ``layer_ids`` of the target ``model`` (once per model; the same Taps after)."""
    text = _text_model(model)
    existing = getattr(text, "_block_taps", None)
    if existing is not None and existing.layer_ids == tuple(layer_ids):
        return existing
    layers = text.model.layers
    taps = Taps(tuple(layer_ids), len(layers) - 1, text.model.norm)
    for index in set(layer_ids):
        layer = layers[index]
        base = getattr(layer, "_tapped_base", type(layer))
        if base not in _TAPPED:
            _TAPPED[base] = type(f"Tapped{base.__name__}", (_Tapped, base), {"_tapped_base": base})
        layer.__class__ = _TAPPED[base]
        layer._taps, layer._tap_index = taps, index
    text._block_taps = taps
    return taps


class Features:
    """The target's features by position, as contiguous pieces [(start, (1, L, F))]: a pass at ``start`` replaces
    whatever was held from ``start`` on (the target recomputes from where it rewound to)."""

    def __init__(self):
        self.pieces: list[tuple[int, mx.array]] = []

    def write(self, start: int, features: mx.array) -> None:
        kept = []
        for begin, piece in self.pieces:
            if begin >= start:
                continue
            end = begin + piece.shape[1]
            kept.append((begin, piece if end <= start else piece[:, : start - begin]))
        kept.append((start, features))
        self.pieces = kept

    def take(self, begin: int, end: int) -> list[tuple[int, mx.array]]:
        """The held runs within [begin, end), dropped from here on; what lies before ``begin`` is dropped too."""
        runs, rest = [], []
        for start, piece in self.pieces:
            stop = start + piece.shape[1]
            lo, hi = max(start, begin), min(stop, end)
            if lo < hi:
                runs.append((lo, piece[:, lo - start : hi - start]))
            if stop > end:
                rest.append((end, piece[:, end - start :]) if start < end else (start, piece))
        self.pieces = rest
        return runs


class TappedModel:
    """The target as a block request calls it: mlx-lm's own call, its tapped layers' outputs written to
    ``features`` by position (one-row calls only)."""

    def __init__(self, model, taps: Taps, features: Features):
        self.target = model
        self.taps = taps
        self.features = features

    @property
    def layers(self):
        return self.target.layers

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, inputs, cache=None, **kwargs):
        start = _offset(cache)
        self.taps.hidden = {}
        try:
            logits = self.target(inputs, cache=cache, **kwargs)
            if start is not None and inputs.shape[0] == 1:
                self.features.write(start, self.taps.features())
        finally:
            self.taps.hidden = None
        return logits


# -- the drafter ------------------------------------------------------------------------------------------------


class BlockDrafter(HiddenStateDrafter):
    """Drafts a block in one pass of the block model (see the module's docstring)."""

    name = "block"

    def __init__(self, model, block: BlockDraftModel):
        text = _text_model(model)
        self.embed = text.model.embed_tokens
        self.block = block
        self.vocab = getattr(block, "draft_vocab", None)
        self.head = lm_head(model) if self.vocab is None else rows_head(model, self.vocab)
        self.size = block.config.block_size
        self.taps = install_taps(model, block.config.target_layer_ids)
        self.features = Features()
        self.caches = [KVCache() for _ in block.layers]  # per layer: the context's keys and values
        self.held = 0  # context positions fed so far (some may be missing: never run through TappedModel)
        self.passes = 0  # forward passes of the block model (one per proposal)
        self._mask = None

    def propose(self, context: list[int], k: int, params: SamplingParams, key) -> Proposal | None:
        if k <= 0:
            return None
        k = min(k, self.size - 1)
        last = len(context) - 1  # the pending token's position: the target has not run it yet
        contexts = self._feed(self.features.take(self.held, last))
        self.held = last
        if contexts is None:
            return None  # nothing of the target's to draft from (yet)
        ids = mx.array([context[-1]] + [self.block.config.mask_token_id] * (self.size - 1))[None]
        self.passes += 1
        hidden = self.block(self.embed(ids), last, contexts)
        logits = self.head(hidden[0, 1 : k + 1])
        if params.greedy:
            tokens = mx.argmax(logits, axis=-1)
            tokens = tokens if self.vocab is None else self.vocab[tokens]
            mx.async_eval(tokens)
            return Proposal(tokens.astype(mx.uint32), None)
        if self.vocab is not None:  # the verifier's q is over the whole vocabulary: the others get none
            logits = to_full_vocabulary(logits, self.vocab, self.embed.weight.shape[0])
        probs, tokens = [], []
        for i, step_key in enumerate(mx.random.split(key, k)):
            tokens.append(draft_token(logits[i], params, step_key, probs))
        tokens = mx.stack(tokens).astype(mx.uint32)
        mx.async_eval(tokens)
        return Proposal(tokens, mx.stack(probs))

    def _feed(self, runs) -> list | None:
        """Each layer's context (keys, values) with ``runs`` of new positions appended; None when empty."""
        for start, features in runs:
            for cache, (keys, values) in zip(self.caches, self.block.context(features, start)):
                cache.update_and_fetch(keys, values)
        if self.caches[0].keys is None:
            return None
        return [(cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]) for cache in self.caches]
