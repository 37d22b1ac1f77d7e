"""The prompt cache: KV caches of finished requests, reused by later requests that share a prefix.

Agent loops and multi-turn chats send a long, growing prefix again on every
turn. The runner keeps the target's (and the draft's) KV caches of finished
requests, keyed by the token sequence they hold. A new request takes the entry
with the longest common prefix: it gets its own copy (trimmed to the shared
part when the entry is longer), so no two requests ever share one mutable
cache, and prefills only the rest.

Bounded by bytes, not entries: every entry counts the ``nbytes`` of its arrays
(the caches' whole buffers, growth slack included), and the least recently used
entries go when a new one would pass ``budget``. The memory policy can empty it
(``clear``) before it releases MLX's pool, since evicted buffers land there.

Caches that cannot be trimmed (recurrent or hybrid layers, ``ArraysCache``) are
reused only when the whole entry is a prefix of the new prompt: there is no
way to take such a state back to an earlier token.

A cold tier (``cold_after`` seconds, the ``prompt_cache_cold_after`` setting):
an entry unused that long has its float KV layers (both models') quantized to
8 bits in groups of 64 (32 for narrower heads; MLX's affine ``mx.quantize``, mlx-lm's
``QuantizedKVCache``), a quarter of float32's bytes plus scales and biases, and
the budget counts what is stored. When a new entry needs room, the least
recently used float entries are quantized before any entry is evicted. A hit on
a cold entry gets a float copy (``mx.dequantize``), so the request decodes as
with any float cache; its tokens are not bit-for-bit those of a cold prefill
(bench/prompt_cache.py measures how close). Sliding-window and recurrent layers
stay as they are. With ``kv_bits`` the entries are quantized already and the
cold tier has nothing to do.

With a disk tier (``runner.prompt_disk``, the ``prompt_cache_dir`` setting),
entries are also written to disk as they are stored, and a lookup that finds
a longer shared prefix on disk than in memory loads that entry back into
memory first: warm prefixes survive the runner's restarts.
"""

from __future__ import annotations

import collections
import copy
import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, can_trim_prompt_cache

MIN_REUSE_TOKENS = 8  # a shorter shared prefix (a BOS token, a template's first marker) is not worth a copy
COLD_BITS = 8
COLD_GROUP_SIZE = 64


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # Compare in blocks first: prompts share long prefixes.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def cache_bytes(caches: list[list]) -> int:
    return sum(c.nbytes for layers in caches if layers for c in layers)


def layer_scaled(total_layers: int):
    """``cache_bytes`` for a rank holding a run of a model's (alike) layers: its target cache's bytes per layer
    times ``total_layers``, the same number on every rank of a pipeline whatever its run's length."""

    def measure(caches: list[list]) -> int:
        target, rest = caches[0], caches[1:]
        per_layer = cache_bytes([target]) // len(target) if target else 0
        return per_layer * total_layers + cache_bytes(rest)

    return measure


def trimmed_copy(layers: list, tokens: int) -> list:
    """A cache holding the first ``tokens`` tokens of ``layers``, sharing no mutable state with it.

    KV layers get views of the first ``tokens`` positions: MLX arrays are
    copy-on-write, so the copy's later writes never reach the entry. Layers of
    other kinds (never trimmed here, see the module doc) are deep-copied.
    """
    out = []
    for layer in layers:
        if isinstance(layer, KVCache):
            fresh = KVCache()
            if layer.keys is not None and tokens > 0:
                fresh.keys = layer.keys[..., :tokens, :]
                fresh.values = layer.values[..., :tokens, :]
                fresh.offset = tokens
            out.append(fresh)
        elif isinstance(layer, QuantizedKVCache):  # (weights, scales, biases) for keys and for values
            fresh = QuantizedKVCache(group_size=layer.group_size, bits=layer.bits)
            if layer.keys is not None and tokens > 0:
                fresh.keys = tuple(a[..., :tokens, :] for a in layer.keys)
                fresh.values = tuple(a[..., :tokens, :] for a in layer.values)
                fresh.offset = tokens
            out.append(fresh)
        else:
            fresh = copy.copy(layer)
            if hasattr(layer, "cache") and isinstance(layer.cache, list):
                fresh.cache = list(layer.cache)  # the arrays are replaced, never written in place
            elif layer.is_trimmable():
                fresh = copy.deepcopy(layer)
                fresh.trim(fresh.size() - tokens)
            out.append(fresh)
    return out


def cooled(layers: list) -> list:
    """The float KV layers of ``layers`` quantized (the cold tier's form); other layers as they are."""
    out = []
    for layer in layers:
        widths = (
            (layer.keys.shape[-1], layer.values.shape[-1]) if type(layer) is KVCache and layer.keys is not None else ()
        )
        group = next((g for g in (COLD_GROUP_SIZE, 32) if widths and all(w % g == 0 for w in widths)), 0)
        if group:  # groups of 64 values, or of 32 for heads 32 wide (a small draft model's)
            cold = layer.to_quantized(group_size=group, bits=COLD_BITS)
            mx.eval(cold.keys, cold.values)  # so the float buffers are freed now
            out.append(cold)
        else:
            out.append(layer)
    return out


def warmed(layers: list) -> list:
    """A float copy of a cold entry's layers (its quantized KV layers dequantized to the scales' dtype)."""
    out = []
    for layer in layers:
        if isinstance(layer, QuantizedKVCache):
            fresh = KVCache()
            if layer.keys is not None:
                size = dict(group_size=layer.group_size, bits=layer.bits)
                fresh.keys = mx.dequantize(*layer.keys, **size)
                fresh.values = mx.dequantize(*layer.values, **size)
                fresh.offset = layer.offset
            out.append(fresh)
        else:
            out.append(layer)
    return out


@dataclass
class Entry:
    tokens: list[int]  # what the caches hold, in order
    caches: list[list]  # one list of layers per model: the target's, then the draft's
    nbytes: int
    used: float = field(default_factory=time.monotonic)  # when it was stored or last hit
    cold: bool = False  # its float KV layers are held quantized (the cold tier)
    namespace: int = 0  # the LoRA adapter it was computed with (runner.loading.adapters; 0: the base alone)


@dataclass
class Hit:
    tokens: int  # prompt tokens the copy holds (0 = a miss)
    caches: list[list] | None  # the request's own copies, or None on a miss


class PromptCache:
    def __init__(self, budget: int, disk=None, cold_after: float = 0.0, clock=time.monotonic, measure=None):
        self.budget = budget
        # An entry's bytes; in a pipelined group, counted as if its target held every layer (``layer_scaled``),
        # so every rank keeps and evicts the same entries whatever its share of the layers.
        self.measure = measure or cache_bytes
        self.disk = disk  # a runner.prompt_disk.DiskTier, or None
        self.cold_after = cold_after  # seconds unused before an entry goes cold; 0 = no cold tier
        self.clock = clock
        self.cold_hits = 0  # hits on a cold entry
        self.cooled = 0  # entries made cold
        self._entries: collections.OrderedDict[int, Entry] = collections.OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evictions = 0
        self.disk_hits = 0  # hits whose entry came back from disk

    @property
    def entries(self) -> int:
        return len(self._entries)

    def contents(self) -> list[tuple[list[int], list[int]]]:
        """What it holds, oldest first: each entry's tokens and how many tokens each layer of its target cache
        holds (for Info-like reports and tests: a stored cache should hold exactly its entry's tokens)."""
        return [(list(e.tokens), [layer.offset for layer in e.caches[0]]) for e in self._entries.values()]

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def cold_entries(self) -> int:
        return sum(e.cold for e in list(self._entries.values()))

    @property
    def cold_bytes(self) -> int:
        return sum(e.nbytes for e in list(self._entries.values()) if e.cold)

    def _cool(self, key: int) -> bool:
        """Quantize one entry in place (the cold tier); False when it has nothing to quantize."""
        entry = self._entries[key]
        caches = [cooled(layers) if layers else layers for layers in entry.caches]
        nbytes = self.measure(caches)
        entry.cold = True  # even with nothing to quantize: it is as small as it gets
        if nbytes >= entry.nbytes:
            return False
        entry.caches = caches
        self.nbytes += nbytes - entry.nbytes
        entry.nbytes = nbytes
        self.cooled += 1
        return True

    def cool_all(self) -> tuple[int, int]:
        """Make every float entry cold now (the memory policy's first step under pressure, before emptying);
        returns (entries quantized, bytes saved). Nothing without a cold tier."""
        if not self.cold_after:
            return 0, 0
        before = self.nbytes
        cooled = sum(self._cool(k) for k, e in list(self._entries.items()) if not e.cold)
        return cooled, before - self.nbytes

    def cool_idle(self) -> int:
        """Make cold every entry unused for ``cold_after`` seconds; returns how many changed."""
        if not self.cold_after:
            return 0
        now = self.clock()
        idle = [k for k, e in self._entries.items() if not e.cold and now - e.used >= self.cold_after]
        return sum(self._cool(k) for k in idle)

    def lookup(self, prompt: list[int], namespace: int = 0) -> Hit:
        """The longest cached prefix of ``prompt`` (never the whole prompt: its last token must be run), among
        the entries of ``namespace`` (the LoRA adapter the request decodes with: another's KV would be wrong)."""
        disk = self.disk if namespace == 0 else None  # the disk tier keeps the base's entries only
        if not self.enabled or not (self._entries or (disk is not None and disk.entries)):
            self.misses += 1
            return Hit(0, None)
        self.cool_idle()
        best_key, best = None, MIN_REUSE_TOKENS - 1
        limit = len(prompt) - 1
        for key, entry in reversed(self._entries.items()):  # on a tie, the most recently used
            if entry.namespace != namespace:
                continue
            shared = min(common_prefix(entry.tokens, prompt), limit)
            if shared < len(entry.tokens) and not all(can_trim_prompt_cache(c) for c in entry.caches if c):
                continue  # an untrimmable state is usable only whole
            if shared > best:
                best_key, best = key, shared
        if disk is not None:
            name, shared = disk.best(prompt, limit)
            loaded = disk.load(name) if name is not None and shared > best else None
            key = self._insert(*loaded) if loaded is not None else None  # into memory, not written again
            if key is not None:  # (None: larger than the memory budget)
                best_key, best = key, shared
                self.disk_hits += 1
        if best_key is None:
            self.misses += 1
            return Hit(0, None)
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        entry.used = self.clock()
        self.hits += 1
        self.reused_tokens += best
        copies = [trimmed_copy(layers, best) if layers else layers for layers in entry.caches]
        if entry.cold:
            self.cold_hits += 1
            copies = [warmed(layers) if layers else layers for layers in copies]
        return Hit(best, copies)

    def store(self, tokens: list[int], caches: list[list], namespace: int = 0) -> int:
        """Keep the caches of a finished request (which no longer uses them), on disk too when there is a disk
        tier (the base's); returns bytes evicted from memory. ``namespace``: its LoRA adapter (0: none)."""
        if not self.enabled or not tokens:
            return 0
        if self.disk is not None and namespace == 0:
            self.disk.store(tokens, caches)
        self.cool_idle()
        return self._insert(tokens, caches, evicted_bytes=True, namespace=namespace)

    def _insert(
        self, tokens: list[int], caches: list[list], evicted_bytes: bool = False, namespace: int = 0
    ) -> int | None:
        """Put an entry in memory; returns the bytes evicted for it (``evicted_bytes``) or its key."""
        nbytes = self.measure(caches)
        if nbytes > self.budget:
            return 0 if evicted_bytes else None
        # An entry that is a prefix of the new one (of the same adapter) adds nothing the new one does not hold,
        # unless the new one cannot be trimmed back to it (a sliding window's: ``keep_prefill``'s entries).
        trimmable = all(can_trim_prompt_cache(c) for c in caches if c)
        for key in [
            k
            for k, e in self._entries.items()
            if trimmable and e.namespace == namespace and common_prefix(e.tokens, tokens) == len(e.tokens)
        ]:
            self._drop(key)
        if self.cold_after:  # quantize the least recently used float entries before evicting any
            for key in [k for k, e in self._entries.items() if not e.cold]:
                if self.nbytes + nbytes <= self.budget:
                    break
                self._cool(key)
        evicted = 0
        while self._entries and self.nbytes + nbytes > self.budget:
            evicted += self._evict_oldest()
        key = self._next_key
        self._entries[key] = Entry(list(tokens), caches, nbytes, self.clock(), namespace=namespace)
        self._next_key += 1
        self.nbytes += nbytes
        return evicted if evicted_bytes else key

    def _drop(self, key: int) -> int:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        return entry.nbytes

    def _evict_oldest(self) -> int:
        key = next(iter(self._entries))
        self.evictions += 1
        return self._drop(key)

    def clear(self) -> tuple[int, int]:
        """Evict every entry; returns (entries, bytes) evicted."""
        entries, nbytes = len(self._entries), self.nbytes
        self.evictions += entries
        self._entries.clear()
        self.nbytes = 0
        return entries, nbytes
