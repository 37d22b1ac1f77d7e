"""Decoding several requests together: one batched forward pass per step.

A ``Batch`` holds the sessions (``runner.session``) that decode together and
one batched cache per layer, built from mlx-lm's batching pieces: each
session's own cache is merged in (``KVCache.merge`` -> ``BatchKVCache``, left
padded to a common length; ``ArraysCache`` and the rotating caches batch the
same way), a newcomer joins with ``extend``, a finished or cancelled session
leaves with ``filter`` (and ``extract`` gives its cache back, for the prompt
cache or to go on alone). Every step feeds each row its pending token, and
each row's session chooses its next token with its own sampling parameters and
random key, and checks its own stop conditions, deadlines and max_tokens.

The release rule in batched mode (``BatchRelease``): a batched cache grows in
256-token steps of its *shared* index, the longest row plus left padding, and
every growth copies the layers into larger buffers, dropping the old ones into
MLX's pool; ``extend`` (a row joins) and ``filter`` (a row leaves) likewise
replace the buffers. So the batch releases the pool after every step that
changed the cache's capacity, and after every join and leave - not every 512
steps as mlx-lm's ``BatchGenerator`` does, by when the pool holds every old
buffer since the last release.

Pipelining: as ``PlainDecoder`` does for one request, a step queues the next
forward pass (fed with the tokens this one chose, still on the device) before
the host reads this step's tokens, so the host's work for every row (stopping
criteria, detokenizing, streaming) overlaps the device's next step. The queued
step is kept across a row leaving (its results are filtered with the cache; a
leaving row's extracted cache is trimmed of the position the queued step
added); ``settle`` hands out its tokens before rows join or the last row goes
on alone, so no row's token - nor the random key it drew - is thrown away.
Caches that cannot be trimmed (recurrent layers) step without the queue.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache

from .kv_quant import BatchQuantizedKVCache
from .rewind import leaves


def merge(caches: list[list], kv=None) -> list:
    """One batched cache per layer from the sessions' own caches (mlx-lm's ``merge`` of each cache class; our
    ``BatchQuantizedKVCache`` for quantized layers). ``kv`` (``runner.kv_quant.KVQuantization``): the float
    layers of a position where another row's is quantized are quantized too."""
    merged = []
    for layers in zip(*caches):
        layers = kv.quantized(list(layers)) if kv is not None else list(layers)
        kind = BatchQuantizedKVCache if type(layers[0]) is QuantizedKVCache else type(layers[0])
        merged.append(kind.merge(layers))
    return merged


def _alike(layer, other, kv):
    """``layer`` and ``other`` (batched, to be joined) in one layout: a float one quantized where the other is."""
    if kv is not None and type(layer) is BatchKVCache and isinstance(other, BatchQuantizedKVCache):
        layer = BatchQuantizedKVCache.of(layer, kv.group_size, kv.bits)
    if kv is not None and type(other) is BatchKVCache and isinstance(layer, BatchQuantizedKVCache):
        other = BatchQuantizedKVCache.of(other, kv.group_size, kv.bits)
    return layer, other


def prefill_rows(model, caches: list[list], suffixes: list[list[int]]) -> None:
    """Run ``suffixes[i]`` through ``model`` on top of ``caches[i]`` for every row, in one batched forward pass,
    and put each row's cache back in its list (the lists are changed in place; their layers are new).

    mlx-lm's batched prefill: the caches are merged (left padded to the longest), the suffixes right padded to
    the longest (``BatchKVCache.prepare``) - the causal mask keeps every real token from seeing the padding
    after it - and ``finalize`` rolls that padding to the left, where the mask hides it from then on. Each row's
    cache is then extracted: exactly its own tokens, at the positions it would have alone."""
    batched = merge(caches)
    lengths = [len(s) for s in suffixes]
    width = max(lengths)
    padding = [width - n for n in lengths]
    for layer in batched:
        layer.prepare(lengths=lengths, right_padding=padding)
    model(mx.array([list(s) + [0] * p for s, p in zip(suffixes, padding)], dtype=mx.uint32), cache=batched)
    for layer in batched:
        layer.finalize()
    mx.eval([layer.state for layer in batched])
    for i, cache in enumerate(caches):
        cache[:] = [layer.extract(i) for layer in batched]
    mx.eval([layer.state for cache in caches for layer in cache])


def prefill_jointly(sessions: list) -> None:
    """The rest of several sessions' prompts (``Decoder.prefill_parts``: short, plain KV caches), one batched
    forward pass per model (the target's, and the draft's for the requests that draft with it)."""
    by_model: dict[int, tuple] = {}
    sizes = []
    for session in sessions:
        parts = session.prefill_parts()
        sizes.append(max(len(tokens) for _, _, tokens, _ in parts))
        for model, cache, tokens, done in parts:
            by_model.setdefault(id(model), (model, []))[1].append((cache, tokens, done))
    for model, parts in by_model.values():
        prefill_rows(model, [cache for cache, _, _ in parts], [tokens for _, tokens, _ in parts])
        for _, _, done in parts:
            done()
    mx.clear_cache()
    for session, size in zip(sessions, sizes):
        session.prefilled_jointly(size)


def capacity(cache: list) -> tuple:
    """What identifies the buffers of a batched cache: their shapes (a growth or a copy changes them)."""
    shapes = []
    for layer in leaves(cache):  # a CacheList's caches one by one
        keys = getattr(layer, "keys", None)
        if isinstance(keys, tuple):  # quantized: (packed values, scales, biases)
            shapes.append(tuple(keys[0].shape) + (getattr(layer, "bits", 0),))
        elif keys is not None:
            shapes.append(tuple(keys.shape))
        else:
            shapes.append(tuple(tuple(a.shape) for a in getattr(layer, "cache", []) if a is not None))
    return tuple(shapes)


class BatchRelease:
    """Release the pool when the batched cache's buffers were replaced (growth, join, leave)."""

    def __init__(self, release, enabled: bool = True):
        self.release = release
        self.enabled = enabled
        self.count = 0
        self._shape = None

    def changed(self) -> None:
        """Rows joined or left: buffers were copied."""
        self._shape = None
        self._release()

    def after_step(self, shape: tuple) -> bool:
        """``shape``: the cache's ``capacity`` once the step was built (its forward pass has run since)."""
        grew = self._shape is not None and shape != self._shape
        self._shape = shape
        if grew:
            self._release()
        return grew

    def _release(self) -> None:
        if self.enabled:
            self.release()
            self.count += 1


class Batch:
    def __init__(self, model, release, release_enabled: bool = True, kv=None):
        self.model = model
        self.kv = kv  # runner.kv_quant.KVQuantization (kv_bits), or None: the batch's cache is quantized as a whole
        self.rows: list = []  # sessions, in the cache's row order
        self.cache: list | None = None
        self.releases = BatchRelease(release, release_enabled)
        self.steps = 0
        self.departures = 0  # times rows left, each one copy of the batched cache
        # The queued step: (chosen tokens, logits, the cache's capacity once it was built), or None.
        self._ahead: tuple[mx.array, mx.array, tuple] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, sessions: list) -> None:
        """Sessions whose caches are settled (prompt in, pending token not yet fed): each hands its cache over
        (``Session.join_batch``).

        The batch must be settled first (no queued step: the newcomers have no part in it)."""
        assert self._ahead is None, "settle the batch before rows join"
        caches = []
        for session in sessions:
            caches.append(session.join_batch())
        joined = merge(caches, self.kv)
        if self.cache is None:
            self.cache = joined
        else:
            for i, extra in enumerate(joined):
                self.cache[i], extra = _alike(self.cache[i], extra, self.kv)
                self.cache[i].extend(extra)
        self.rows += sessions
        mx.eval([layer.state for layer in self.cache])
        self.releases.changed()

    def leave(self, sessions: list, give_back: list[bool]) -> None:
        """Remove rows, all in one copy of the batched cache; ``give_back[i]`` returns ``sessions[i]`` its own
        cache (to go on alone or feed the prompt cache; ``Session.leave_batch``)."""
        indices = [self.rows.index(s) for s in sessions]
        for session, index, own_back in zip(sessions, indices, give_back):
            own = None
            if own_back:
                own = [layer.extract(index) for layer in self.cache]
                if self._ahead is not None:  # the queued step fed its pending token: not its to keep
                    for layer in own:
                        layer.trim(1)
                mx.eval([layer.state for layer in own])  # a lazy copy would keep the whole batch's buffers alive
            session.leave_batch(own)
        leaving = set(indices)
        self.departures += 1
        keep = [i for i in range(len(self.rows)) if i not in leaving]
        self.rows = [self.rows[i] for i in keep]
        if keep:
            for layer in self.cache:
                layer.filter(keep)
            if self._ahead is not None:  # the queued step goes on for the rows that stay
                chosen, logits, _ = self._ahead
                rows = mx.array(keep)
                self._ahead = (chosen[rows], logits[rows], capacity(self.cache))
            mx.eval([layer.state for layer in self.cache])
        else:
            self.cache = None
            self._ahead = None
        self.releases.changed()

    def _forward(self, inputs: mx.array) -> tuple[mx.array, mx.array, tuple]:
        """Build one batched forward pass of ``inputs`` (one token a row) and each row's choice after it."""
        rows = self.rows
        logits = self.model(inputs, cache=self.cache)[:, -1, :]
        if all(s.plain_choice for s in rows):
            chosen = mx.argmax(logits, axis=-1)
        else:  # each row by its own rule; a sampling row draws its next key, as alone
            chosen = mx.stack([s.choose_next(logits[i]) for i, s in enumerate(rows)])
        return chosen, logits, capacity(self.cache)

    def _deliver(self, chosen: mx.array, logits: mx.array) -> list:
        tokens = chosen.tolist()
        self.steps += 1
        rounds = []
        for i, (session, token) in enumerate(zip(self.rows, tokens)):
            rounds.append((session, session.batch_step(token, logits[i : i + 1])))
        return rounds

    def settle(self) -> list:
        """The queued step's tokens, handed to their rows (as ``step`` does); then nothing is queued."""
        if self._ahead is None:
            return []
        chosen, logits, shape = self._ahead
        self._ahead = None
        rounds = self._deliver(chosen, logits)
        self.releases.after_step(shape)
        return rounds

    def step(self) -> list:
        """One batched step: each row's next token, through its session. Returns (session, Round).

        The next step is queued before this one's tokens are read (caches that can be trimmed only)."""
        if self.kv is not None:  # a float batch whose longest row passed quantized_kv_start (a queued step's
            self.kv.apply(self.cache)  # position included: it is in the cache the step was built on)
        if self._ahead is None:
            inputs = mx.array([[s.pending] for s in self.rows], dtype=mx.uint32)
            self._ahead = self._forward(inputs)
            mx.async_eval(self._ahead[0])
        chosen, logits, shape = self._ahead
        self._ahead = None
        # Not with a row under a grammar: its mask for the next step needs this step's token on the host.
        if all(layer.is_trimmable() for layer in self.cache) and not any(s.constrained for s in self.rows):
            self._ahead = self._forward(chosen[:, None].astype(mx.uint32))
            mx.async_eval(self._ahead[0])
        rounds = self._deliver(chosen, logits)
        self.releases.after_step(shape)  # this step's forward pass has run: its old buffers are in the pool
        return rounds
