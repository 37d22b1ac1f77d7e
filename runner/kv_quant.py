"""Quantized KV caches: more context, and more cached prompts, in the same memory.

``kv_bits`` (8 or 4) stores the target's keys and values in MLX's affine
layout (``mx.quantize``: per ``kv_group_size`` values along a head, a scale and
a bias), and attention reads them with quantized matrix products (mlx-lm's
``QuantizedKVCache`` and ``quantized_scaled_dot_product_attention``). As in
mlx-lm's ``generate_step``, a cache stays in float until it holds more than
``quantized_kv_start`` tokens, then the whole of it is quantized in place and
every later token is quantized as it is written: short requests pay nothing,
and a long one pays once.

What it covers, and what it does not:

- The target's full-attention layers (``KVCache``). Sliding-window layers
  (``RotatingKVCache``; mlx-lm cannot quantize them) and recurrent states stay
  as they are; so does the draft model's cache, a small fraction of the
  target's.
- Speculation: ``QuantizedKVCache`` trims like a float cache, so rejected
  drafts are dropped as before (``runner.rewind``).
- The prompt cache stores quantized entries as they are, at their quantized
  size, and the disk tier writes them so (its identity includes these settings).
- The release rule is unchanged: a quantized cache grows in the same 256-token
  steps.
- Batching: mlx-lm has no batched quantized cache, so ``BatchQuantizedKVCache``
  is one: ``BatchKVCache``'s left-padded rows, merge / extend / filter /
  extract and mask, over the (packed values, scales, biases) triples of
  ``QuantizedKVCache``; attention reads it as it reads one request's. A batch
  is quantized as a whole: rows that join a quantized batch are quantized then,
  and a float batch (every row under ``quantized_kv_start``) is quantized when
  its longest row passes it. With the default start (0) every row is quantized
  after its prefill, as alone, and a batched row's tokens are its tokens alone.
  The batch's memory is projected at the quantized bytes per token
  (``runner.batch_memory``): at 8 bits a ``batch_memory`` holds 1.9x (bf16) to
  3.6x (float32) the rows it holds in float.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll


@dataclass(frozen=True)
class KVQuantization:
    bits: int
    group_size: int = 64
    start: int = 0  # a cache is quantized once it holds more than this many tokens

    def apply(self, cache: list | None) -> int:
        """Quantize, in place, every float full-attention layer of ``cache`` that is due; returns how many. A
        batched layer is due when its longest row is."""
        if cache is None:
            return 0
        done = 0
        for i, layer in enumerate(cache):
            if type(layer) is KVCache and layer.offset > self.start:
                cache[i] = layer.to_quantized(group_size=self.group_size, bits=self.bits)
                done += 1
            elif type(layer) is BatchKVCache and layer.size() > self.start:
                cache[i] = BatchQuantizedKVCache.of(layer, self.group_size, self.bits)
                done += 1
        return done

    def quantized(self, layers: list) -> list:
        """``layers`` (one layer position's caches, of rows about to be batched together) all quantized where
        any one is: a batch is quantized as a whole."""
        if not any(isinstance(layer, QuantizedKVCache) for layer in layers):
            return layers
        return [
            layer.to_quantized(group_size=self.group_size, bits=self.bits) if type(layer) is KVCache else layer
            for layer in layers
        ]

    def value_bytes(self, itemsize: int) -> float:
        """Bytes one cached value takes: its bits, and its group's scale and bias in the cache's float type."""
        return self.bits / 8 + 2 * itemsize / self.group_size

    def check_heads(self, head_dims: list[int]) -> str:
        """Why ``group_size`` cannot quantize heads of these widths ("" when it can)."""
        bad = sorted({d for d in head_dims if d % self.group_size})
        if bad:
            return f"kv_group_size {self.group_size} does not divide the attention heads' width ({bad[0]})"
        return ""


class BatchQuantizedKVCache(BatchKVCache):
    """Left-padded rows (``BatchKVCache``) whose keys and values are quantized: each a (packed values, scales,
    biases) triple, as in ``QuantizedKVCache``. ``bits`` and ``group_size`` make mlx-lm's attention use its
    quantized product, with this cache's mask (each row's left padding hidden)."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    @classmethod
    def of(cls, batch: BatchKVCache, group_size: int, bits: int) -> BatchQuantizedKVCache:
        """A float batch's rows, quantized."""
        cache = cls([], group_size, bits)
        cache.left_padding, cache.offset, cache._idx = batch.left_padding, batch.offset, batch._idx
        if batch.keys is not None:
            keys, values = batch.keys[..., : batch._idx, :], batch.values[..., : batch._idx, :]
            cache.keys = tuple(mx.quantize(keys, group_size=group_size, bits=bits))
            cache.values = tuple(mx.quantize(values, group_size=group_size, bits=bits))
        return cache

    def update_and_fetch(self, keys, values):
        prev = self._idx
        steps = keys.shape[2]
        if self.keys is None or prev + steps > self.keys[0].shape[2]:
            batch, heads = keys.shape[:2]
            grown = (self.step + steps - 1) // self.step * self.step

            def zeros(width: int, dtype) -> tuple:
                per_word = 32 // self.bits
                return (
                    mx.zeros((batch, heads, grown, width // per_word), dtype=mx.uint32),
                    mx.zeros((batch, heads, grown, width // self.group_size), dtype=dtype),
                    mx.zeros((batch, heads, grown, width // self.group_size), dtype=dtype),
                )

            new_k, new_v = zeros(keys.shape[-1], keys.dtype), zeros(values.shape[-1], values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys, self.values = tree_map(
                    lambda old, new: mx.concatenate([old[..., :prev, :], new], axis=2),
                    (self.keys, self.values),
                    (new_k, new_v),
                )
        self.offset = self.offset + steps
        self._idx += steps
        for stored, new in ((self.keys, keys), (self.values, values)):
            for array, part in zip(stored, mx.quantize(new, group_size=self.group_size, bits=self.bits)):
                array[..., prev : self._idx, :] = part
        return self.keys_and_values()

    def keys_and_values(self):
        return tree_map(lambda x: x[..., : self._idx, :], (self.keys, self.values))

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys, self.values = tree_map(
                lambda x: dynamic_roll(x, padding[:, None], axis=2), (self.keys, self.values)
            )
            self.offset = self.offset - padding
            self.left_padding += padding
            self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other):
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        like = (self if self.keys is not None else other).keys + (self if self.keys is not None else other).values

        def padded(c) -> tuple:
            left = idx - c._idx
            if c.keys is None:
                rows = c.offset.shape[0]
                arrays = [mx.zeros((rows, a.shape[1], 0, a.shape[3]), dtype=a.dtype) for a in like]
            else:
                arrays = list(c.keys + c.values)
            out = []
            for a in arrays:
                right = size - a.shape[2] - left
                if right < 0:
                    a, right = a[..., :right, :], 0
                if left or right:
                    a = mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)])
                out.append(a)
            return tuple(out), c.offset, c.left_padding + left

        (mine, my_offset, my_padding), (theirs, their_offset, their_padding) = padded(self), padded(other)
        arrays = [mx.concatenate([a, b]) for a, b in zip(mine, theirs)]
        self.keys, self.values = tuple(arrays[:3]), tuple(arrays[3:])
        self.offset = mx.concatenate([my_offset, their_offset])
        self.left_padding = mx.concatenate([my_padding, their_padding])
        self._idx = idx

    def extract(self, idx):
        cache = QuantizedKVCache(group_size=self.group_size, bits=self.bits)
        padding = self.left_padding.tolist()[idx]
        cache.keys, cache.values = tree_map(
            lambda x: mx.contiguous(x[idx : idx + 1, :, padding : self._idx]), (self.keys, self.values)
        )
        cache.offset = self._idx - padding
        return cache

    @classmethod
    def merge(cls, caches):
        """One batch of quantized single-request caches (``QuantizedKVCache``), left padded to the longest."""
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        group_size, bits = caches[0].group_size, caches[0].bits
        if longest == 0:
            return cls([0] * len(caches), group_size, bits)
        padding = [longest - n for n in lengths]
        full = next(c for c in caches if c.keys is not None)
        arrays = []
        for part in full.keys + full.values:
            arrays.append(mx.zeros((len(caches), part.shape[1], longest, part.shape[3]), dtype=part.dtype))
        for i, (p, c) in enumerate(zip(padding, caches)):
            if c.keys is None:
                continue
            for out, part in zip(arrays, c.keys + c.values):
                out[i : i + 1, :, p : p + c.offset] = part[..., : c.offset, :]
        cache = cls(padding, group_size, bits)
        cache.keys, cache.values = tuple(arrays[:3]), tuple(arrays[3:])
        cache.offset += longest
        cache._idx = longest
        return cache

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.keys + self.values)
