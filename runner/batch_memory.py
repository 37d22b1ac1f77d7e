"""How many requests may decode together in the memory the runner has for their caches.

A batch keeps one KV buffer per layer for all its rows (``runner.batch``), as
long as its longest row plus left padding, grown in 256-token steps. A request
admitted now may grow to its prompt plus its max_tokens (capped by the
context; a client that sets no max_tokens may fill the context). So before the
worker admits a request next to others, it projects the batch's caches if every
row ran to its end - rows x the longest projected row, in 256-token steps, at
the bytes per token measured on the loaded model (``CacheCost.measure``) - and
admits it only while that stays within ``budget``; otherwise the request waits,
first in first out, until rows leave. A lone request is always admitted: the
supervisor admitted the model for one request over its whole context
(``supervisor.memory.admit``), and sets the budget from the room above that
(``supervisor.memory.batch_memory_budget``). The projection leaves out the
transient copy while a row joins (merge and extend copy the caches once).

``budget=None`` (a runner started without one) admits up to ``max_batch``, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

STEP = BatchKVCache.step  # a batched cache grows in steps of this many positions (256)


@dataclass(frozen=True)
class CacheCost:
    per_token: int  # bytes a row's caches take per position (layers whose buffers grow with the context)
    per_row: int  # bytes a row's caches take whatever its length (recurrent states)
    # With kv_bits: bytes per position once the full-attention layers are quantized, and the length from which
    # a batch is (runner.kv_quant: a batch is quantized as a whole once its longest row passes the start).
    quantized_per_token: int | None = None
    quantized_from: int = 0

    @classmethod
    def measure(cls, model, kv=None) -> CacheCost:
        """Run one token through a fresh cache of ``model`` and read what its layers allocated; ``kv``
        (``runner.kv_quant.KVQuantization``): what its full-attention layers take quantized."""
        cache = make_prompt_cache(model)
        model(mx.array([[0]], dtype=mx.uint32), cache=cache)
        mx.eval([layer.state for layer in cache])
        per_token = per_row = quantized = 0
        for layer in cache:
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.ndim == 4:  # KV layers: (batch, heads, positions, dim)
                float_bytes = (keys.nbytes + layer.values.nbytes) // keys.shape[2]
                per_token += float_bytes
                if kv is not None and type(layer) is KVCache:
                    values = (keys.size + layer.values.size) // keys.shape[2]
                    quantized += round(values * kv.value_bytes(keys.itemsize))
                else:
                    quantized += float_bytes
            else:
                per_row += layer.nbytes
        del cache
        mx.clear_cache()
        if kv is None:
            return cls(per_token, per_row)
        return cls(per_token, per_row, quantized, kv.start)

    def batch(self, lengths: list[int]) -> int:
        """Bytes of one batch whose rows reach ``lengths`` tokens: every row as long as the longest."""
        if not lengths:
            return 0
        longest = max(lengths)
        positions = -(-longest // STEP) * STEP
        per_token = self.per_token
        if self.quantized_per_token is not None and longest > self.quantized_from:
            per_token = self.quantized_per_token
        return len(lengths) * (positions * per_token + self.per_row)


class BatchMemory:
    def __init__(self, cost: CacheCost, budget: int | None):
        self.cost = cost
        self.budget = budget

    @staticmethod
    def projected(prepared) -> int:
        """The most tokens a request's cache can hold: its prompt and every token it may generate."""
        return len(prepared.prompt_ids) + prepared.max_tokens

    def admits(self, active: list, newcomer) -> bool:
        """Whether ``newcomer`` (a PreparedRequest) may decode next to ``active`` ones."""
        if not active or self.budget is None:
            return True
        lengths = [self.projected(p) for p in active] + [self.projected(newcomer)]
        return self.cost.batch(lengths) <= self.budget
