"""Attention on CUDA without a cuDNN plan per shape.

MLX's CUDA backend runs ``mx.fast.scaled_dot_product_attention`` two ways: a
vector kernel for one query token without an array mask, and cuDNN's fused
attention for everything else. cuDNN builds an execution plan for every exact
shape (batch, heads, query length, key length) and keeps 256 of them. Building
one took 45-65 ms on an H200 (2026-12-04, docs/gpu.md), and a server meets a
new shape at almost every step: a verify pass of k drafts has k + 1 query
tokens over a cache one round longer than the last, a batched step has an
array mask over a cache one token longer, and a prompt of a new length. So
speculation decoded at ~15 rounds/s the first time through a prompt and at
~210 rounds/s over the same prompt again (the plans cached): a 4.7 ms round
paid ~60 ms.

So on CUDA an attention whose score matrix is small (``MAX_SCORE_BYTES``) runs
as plain MLX ops, the way MLX's own fallback composes it: scaled ``Q Kᵀ``, the
mask, a softmax in float32, times ``V``. Their kernels are compiled once per
dtype and layout, not per length, and matrix products go to cuBLAS. A large
one (a long prompt's prefill) keeps cuDNN, whose plan costs little next to the
pass. A single query token without an array mask keeps the vector kernel.

``applies()`` says whether to use it: the CUDA backend. ``MLXSERVE_PLAIN_ATTENTION=0``
or ``=1`` overrides that (the tests turn it on for the CPU, where the results must
match MLX's own attention).
"""

from __future__ import annotations

import os
import sys

import mlx.core as mx

from ..platform import backend

ENV = "MLXSERVE_PLAIN_ATTENTION"
# Scores as float32: 16 query tokens x 32 heads x 32k keys is 64 MiB.
MAX_SCORE_BYTES = 256 * 2**20


def applies() -> bool:
    setting = os.environ.get(ENV)
    if setting in ("0", "1"):
        return setting == "1"
    return backend() == "cuda"


def _causal(queries: int, keys: int) -> mx.array:
    """Query i (the last ``queries`` positions of ``keys``) sees keys up to its own position."""
    return (mx.arange(queries)[:, None] + (keys - queries)) >= mx.arange(keys)[None]


def plain_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask=None) -> mx.array:
    """Scaled dot-product attention from plain ops. ``q``: (B, H, L, D); ``k``, ``v``: (B, Hkv, S, D) with H a
    multiple of Hkv (grouped queries); ``mask``: None, "causal", or an array broadcastable to (B, H, L, S),
    boolean (True attends) or additive."""
    b, heads, length, depth = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # (B, Hkv, G, L, D) against (B, Hkv, 1, S, D): each key head serves its group without copies.
    q = (q * scale).reshape(b, kv_heads, group, length, depth)
    scores = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = _causal(length, keys)
    if mask is not None:
        if mask.ndim >= 3 and mask.shape[-3] == heads and heads > 1:
            mask = mask.reshape(*mask.shape[:-3], kv_heads, group, length, keys)
        elif mask.ndim >= 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask.astype(scores.dtype)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ mx.expand_dims(v, 2)).reshape(b, heads, length, -1)


def attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` with the rule above; anything else goes to mlx-lm's own."""
    from mlx_lm.models.base import scaled_dot_product_attention

    b, heads, length, _ = queries.shape
    if hasattr(cache, "bits"):  # a quantized cache (kv_bits): keys are (weights, scales, biases)
        return scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    vector_kernel = length == 1 and not isinstance(mask, mx.array)
    small = b * heads * length * keys.shape[2] * 4 <= MAX_SCORE_BYTES
    if vector_kernel or not small or sinks is not None:
        return scaled_dot_product_attention(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return plain_attention(queries, keys, values, scale, mask)


def use_plain_attention(model) -> int:
    """Route ``model``'s attention through ``attention``: mlx-lm's model modules call the name
    ``scaled_dot_product_attention`` they imported from ``mlx_lm.models.base``, so the name is replaced in each
    module of the model's layers, for the whole process (every model of that architecture in it). Returns how
    many of the model's modules route through it (0: an architecture that calls attention another way keeps
    its own)."""
    from mlx_lm.models import base

    changed = 0
    for name in {type(module).__module__ for _, module in model.named_modules()}:
        module = sys.modules.get(name)
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = attention
        changed += getattr(module, "scaled_dot_product_attention", None) is attention
    return changed
