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
"""

from __future__ import annotations

import mlx.core as mx

from .sampling import filtered_probs, sample


def merge(caches: list[list]) -> list:
    """One batched cache per layer from the sessions' own caches (mlx-lm's ``merge`` of each cache class)."""
    return [type(layers[0]).merge(list(layers)) for layers in zip(*caches)]


def capacity(cache: list) -> tuple:
    """What identifies the buffers of a batched cache: their shapes (a growth or a copy changes them)."""
    shapes = []
    for layer in cache:
        keys = getattr(layer, "keys", None)
        if keys is not None:
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

    def after_step(self, cache: list) -> bool:
        shape = capacity(cache)
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
    def __init__(self, model, release, release_enabled: bool = True):
        self.model = model
        self.rows: list = []  # sessions, in the cache's row order
        self.cache: list | None = None
        self.releases = BatchRelease(release, release_enabled)
        self.steps = 0

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, sessions: list) -> None:
        """Sessions whose decoders hold a settled cache (prompt in, pending token not yet fed)."""
        caches = []
        for session in sessions:
            caches.append(session.decoder.hand_over())
            session.batched = True
        joined = merge(caches)
        if self.cache is None:
            self.cache = joined
        else:
            for layer, extra in zip(self.cache, joined):
                layer.extend(extra)
        self.rows += sessions
        mx.eval([layer.state for layer in self.cache])
        self.releases.changed()

    def leave(self, sessions: list, give_back: bool) -> None:
        """Remove rows; ``give_back`` returns each its own cache (to go on alone or feed the prompt cache)."""
        indices = [self.rows.index(s) for s in sessions]
        if give_back:
            for session, index in zip(sessions, indices):
                own = [layer.extract(index) for layer in self.cache]
                mx.eval([layer.state for layer in own])  # a lazy copy would keep the whole batch's buffers alive
                session.decoder.take_back(own)
        for session in sessions:
            session.batched = False
        keep = [i for i in range(len(self.rows)) if i not in set(indices)]
        self.rows = [self.rows[i] for i in keep]
        if keep:
            for layer in self.cache:
                layer.filter(keep)
            mx.eval([layer.state for layer in self.cache])
        else:
            self.cache = None
        self.releases.changed()

    def step(self) -> list:
        """One batched forward pass: each row's next token, through its session. Returns (session, Round)."""
        rows = self.rows
        inputs = mx.array([[s.decoder.pending] for s in rows], dtype=mx.uint32)
        logits = self.model(inputs, cache=self.cache)[:, -1, :]
        greedy = [s.decoder.params.greedy for s in rows]
        if all(greedy):
            chosen = mx.argmax(logits, axis=-1)
        else:
            picks = []
            for i, session in enumerate(rows):
                decoder = session.decoder
                if greedy[i]:
                    picks.append(mx.argmax(logits[i], axis=-1))
                else:
                    (key,) = decoder._keys(1)
                    picks.append(sample(filtered_probs(logits[i], decoder.params), key))
            chosen = mx.stack(picks)
        tokens = chosen.tolist()
        self.steps += 1
        rounds = []
        for i, (session, token) in enumerate(zip(rows, tokens)):
            session.decoder.fed_by_batch([token])
            session.decoder.stats.depths[0] += 1
            rounds.append((session, session.take([token], 0, 0, logits[i : i + 1])))
        self.releases.after_step(self.cache)
        return rounds
