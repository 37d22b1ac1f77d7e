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

A sliding-window layer (``RotatingKVCache``) can be trimmed until its window
is full; after that, new tokens overwrite the oldest ones in the window, so the
``Rewinder`` keeps that layer's state too: its buffers (a second reference,
``mx.array(keys)``, which an in-place write of a one-token step leaves as it
was, at the price of a copy of the window; a verification pass of several
tokens replaces the buffers and copies nothing more) and its offsets.

A ``CacheList`` layer (falcon_h1, baichuan_m1: a convolution state and a KV
cache per layer) is taken apart: each cache in it is trimmed, or kept and
restored, like a layer of its own (``leaves``).

A cache with layers of any other kind that cannot be trimmed is not
rewindable: ``rewindable`` says so, and the engine serves such a model with
plain decoding.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

# Layers that can always drop their last tokens (a rotating window cannot once it is full).
ALWAYS_TRIMMABLE = (KVCache, QuantizedKVCache, ConcatenateKVCache)
# Layers whose state the Rewinder keeps before a round and restores after a rejection.
RESTORABLE = (ArraysCache, RotatingKVCache)


def leaves(cache: list) -> list:
    """The caches a model's cache list holds, with every ``CacheList`` taken apart into its own caches."""
    found = []
    for layer in cache:
        found.extend(leaves(layer.caches) if isinstance(layer, CacheList) else [layer])
    return found


def rewindable(cache: list) -> bool:
    """Every layer can always be trimmed, or is one whose state can be kept and restored."""
    return all(isinstance(layer, ALWAYS_TRIMMABLE + RESTORABLE) for layer in leaves(cache))


def _kept(layer):
    """What restores ``layer`` (one of RESTORABLE) to now."""
    if isinstance(layer, ArraysCache):
        return list(layer.cache), layer.left_padding, layer.lengths
    copy = lambda a: None if a is None else mx.array(a)  # noqa: E731 - a reference an in-place write leaves as is
    return copy(layer.keys), copy(layer.values), layer.offset, layer._idx


def _restore(layer, kept) -> None:
    if isinstance(layer, ArraysCache):
        layer.cache, layer.left_padding, layer.lengths = list(kept[0]), kept[1], kept[2]
    else:
        layer.keys, layer.values, layer.offset, layer._idx = kept


class Rewinder:
    def __init__(self, model, cache: list):
        self.model = model
        self.cache = cache
        self.restores = any(isinstance(layer, RESTORABLE) for layer in leaves(cache))
        self._saved: list | None = None

    @property
    def trimmable(self) -> bool:
        """Every layer can drop its last tokens now (a sliding window: until it is full)."""
        return can_trim_prompt_cache(self.cache)

    def snapshot(self) -> None:
        """Before feeding tokens that may be taken back."""
        if self.restores:
            self._saved = [_kept(layer) if isinstance(layer, RESTORABLE) else None for layer in leaves(self.cache)]

    def rewind(self, fed: list[int], keep: int) -> None:
        """Keep the first ``keep`` of the ``fed`` tokens given since the snapshot; forget the rest."""
        # Let the snapshot go now: a sliding window's kept buffers would make its next one-token write copy it.
        saved, self._saved = self._saved, None
        drop = len(fed) - keep
        if drop <= 0:
            return
        if self.trimmable:
            trim_prompt_cache(self.cache, drop)
            return
        for layer, kept in zip(leaves(self.cache), saved):
            if kept is not None:
                _restore(layer, kept)
            else:
                layer.trim(len(fed))
        if keep:
            self.model(mx.array(fed[:keep])[None], cache=self.cache)
            mx.eval([c.state for c in self.cache])
