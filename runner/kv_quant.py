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
- Batching: mlx-lm's batched caches refuse quantized layers, so a runner with
  ``kv_bits`` decodes one request at a time (``max_batch`` is 1; the runner says
  so at start-up and in Info).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache


@dataclass(frozen=True)
class KVQuantization:
    bits: int
    group_size: int = 64
    start: int = 0  # a cache is quantized once it holds more than this many tokens

    def apply(self, cache: list | None) -> int:
        """Quantize, in place, every float full-attention layer of ``cache`` that is due; returns how many."""
        if cache is None:
            return 0
        done = 0
        for i, layer in enumerate(cache):
            if type(layer) is KVCache and layer.offset > self.start:
                cache[i] = layer.to_quantized(group_size=self.group_size, bits=self.bits)
                done += 1
        return done

    def value_bytes(self, itemsize: int) -> float:
        """Bytes one cached value takes: its bits, and its group's scale and bias in the cache's float type."""
        return self.bits / 8 + 2 * itemsize / self.group_size

    def check_heads(self, head_dims: list[int]) -> str:
        """Why ``group_size`` cannot quantize heads of these widths ("" when it can)."""
        bad = sorted({d for d in head_dims if d % self.group_size})
        if bad:
            return f"kv_group_size {self.group_size} does not divide the attention heads' width ({bad[0]})"
        return ""
