"""Taking a model's cache back to an earlier token, for every kind of cache.

Speculative decoding feeds a model tokens that may be rejected, then has to
forget them. KV caches can drop their last tokens (``trim``). Recurrent and
hybrid layers (mlx-lm's ``ArraysCache``: convolution and SSM states) hold a
state that cannot be taken back, so for them the ``Rewinder`` keeps the state
from before the round (``snapshot``: the arrays are replaced, never written in
place, so keeping references is enough), and on a rejection restores it, trims
the KV layers by everything the round fed, and feeds the kept tokens again.
That costs one more forward pass of the kept tokens, only in rounds that
rejected something; every kept token ends up in every layer exactly once.

A cache with layers of any other kind that cannot be trimmed (a rotating
window past its size, say) is not rewindable: ``rewindable`` says so, and the
engine serves such a model with plain decoding.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (ArraysCache, ConcatenateKVCache, KVCache, QuantizedKVCache, can_trim_prompt_cache,
                                 trim_prompt_cache)

# Layers that can always drop their last tokens (a rotating window cannot once it is full).
ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)


def rewindable(cache: list) -> bool:
    """Every layer can always be trimmed, or is an ArraysCache whose state can be kept and restored."""
    return all(isinstance(layer, ALWAYS_TRIMMABLE + (ArraysCache,)) for layer in cache)


class Rewinder:
    def __init__(self, model, cache: list):
        self.model = model
        self.cache = cache
        self.trimmable = can_trim_prompt_cache(cache)
        self._saved: list | None = None

    def snapshot(self) -> None:
        """Before feeding tokens that may be taken back."""
        if not self.trimmable:
            self._saved = [(list(layer.cache), layer.left_padding, layer.lengths)
                           if isinstance(layer, ArraysCache) else None for layer in self.cache]

    def rewind(self, fed: list[int], keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens given since the snapshot; forget the rest."""
        drop = len(fed) - keep
        if drop <= 0:
            return
        if self.trimmable:
            trim_prompt_cache(self.cache, drop)
            return
        for layer, saved in zip(self.cache, self._saved):
            if saved is not None:
                layer.cache, layer.left_padding, layer.lengths = list(saved[0]), saved[1], saved[2]
            else:
                layer.trim(len(fed))
        if keep:
            self.model(mx.array(fed[:keep])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
