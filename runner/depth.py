"""The draft depth: how many tokens to draft in the next round, learned as the runner goes.

Per runner and drafter, the ``DepthController`` keeps moving averages of
- the acceptance at each draft position: a_i, the chance that draft i is kept
  when every draft before it was;
- the wall time of a round at each depth k (draft, verify, rewind and the host's
  work on what it emitted).

A round of depth k emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens on
average, so it picks the k with the most expected tokens per second,
E(k) / T(k), among the depths it has timed - k = 0 (plain decoding) when no
drafting pays. Now and then it tries a neighbour of the best depth (one
deeper, then one shallower, in turn), so a depth that starts to pay is found
and one that stops paying is left. A probe costs: the neighbour is slower than
the best, or it would be the best. So the interval backs off: it starts at
``probe_every`` rounds, doubles after each probe that leaves the best depth
where it was, up to ``max_probe_every``, and falls back to ``probe_every`` as
soon as the best depth changes (by a probe, or because its acceptance moved).
From plain decoding (k = 0) it does not back off: a probe at k = 1 costs
little (one forward pass of two tokens, about the price of one), and the
output may start copying at any moment.
Dropping to a shallower depth needs no probe: the best depth's own rounds
keep the acceptance of its positions current.

Wall times on a shared machine are noisy, and the noise is one-sided: a round
the OS delays looks slow. So a round counts for at most ``SPIKE`` times its
depth's average (one late round does not make a depth look slow for the many
rounds until it is tried again), and the best depth changes only to one
expected to be at least ``MARGIN`` faster (no flapping between two depths
that are about as good). Greedy output does not depend on
the depth; a seeded sampling request pins k instead, so that its samples do
not depend on timing.
"""

from __future__ import annotations

import collections

DEFAULT_MAX_DEPTH = 6
SMOOTHING = 0.2  # weight of the newest round in the moving averages
PRIOR_ACCEPTANCE = 0.5
PROBE_EVERY = 10
MAX_PROBE_EVERY = 80
SPIKE = 1.5  # a round counts for at most this times its depth's average
MARGIN = 0.02  # another depth becomes the best when expected this much faster


class DepthController:
    def __init__(self, max_depth: int = DEFAULT_MAX_DEPTH, start: int = 1, probe_every: int = PROBE_EVERY,
                 max_probe_every: int = MAX_PROBE_EVERY, smoothing: float = SMOOTHING):
        self.max_depth = max_depth
        self.start = min(start, max_depth)
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        self.interval = probe_every  # rounds between probes now
        self._since_probe = 0
        self._probed_from: int | None = None  # the best depth when the pending probe was chosen
        self._last_best: int | None = None  # the best depth the last choice saw
        self.smoothing = smoothing
        self.acceptance = [PRIOR_ACCEPTANCE] * max_depth  # a_1..a_max (index 0 is a_1)
        self.seconds: dict[int, float] = {}  # depth -> moving average of a round's seconds
        self.rounds = 0
        self._probe_up = True
        self.histogram: collections.Counter[int] = collections.Counter()

    def expected_tokens(self, depth: int) -> float:
        total, kept = 1.0, 1.0
        for i in range(depth):
            kept *= self.acceptance[i]
            total += kept
        return total

    def rate(self, depth: int) -> float:
        """Expected tokens per second at ``depth`` (0 when it was never timed)."""
        seconds = self.seconds.get(depth)
        return self.expected_tokens(depth) / seconds if seconds else 0.0

    def best(self) -> int:
        if not self.seconds:
            return self.start
        leader = max(self.seconds, key=self.rate)
        held = self._last_best
        if held in self.seconds and self.rate(leader) <= (1 + MARGIN) * self.rate(held):
            return held
        return leader

    def choose(self) -> int:
        """The depth for the next round."""
        self.rounds += 1
        best = self.best()
        if len(self.seconds) < 2 and self.rounds > 1:
            # Time plain decoding and the starting depth before trusting either.
            return 0 if 0 not in self.seconds else self.start
        if best != self._last_best:  # the best depth moved: look around it at the base rate again
            self._last_best, self.interval = best, self.probe_every
        self._since_probe += 1
        if self._since_probe >= self.interval:
            self._since_probe = 0
            self._probe_up = not self._probe_up
            up, down = min(best + 1, self.max_depth), max(best - 1, 0)
            self._probed_from = best
            return up if (self._probe_up and up != best) or down == best else down
        return best

    def record(self, drafted: int, accepted: int, seconds: float | None) -> None:
        """A round drafted ``drafted`` tokens (its depth), kept ``accepted`` and took ``seconds`` (None: not
        timed, e.g. a request's first round, which carries one-off costs)."""
        self.histogram[drafted] += 1
        w = self.smoothing
        for i in range(min(drafted, accepted + 1)):  # positions the verification reached
            kept = 1.0 if i < accepted else 0.0
            self.acceptance[i] += w * (kept - self.acceptance[i])
        previous = self.seconds.get(drafted)
        if seconds is not None:
            self.seconds[drafted] = (seconds if previous is None
                                     else previous + w * (min(seconds, SPIKE * previous) - previous))
        if self._probed_from is not None:
            if self.best() == self._probed_from > 0:  # the probe lost: wait longer before the next one
                self.interval = min(2 * self.interval, self.max_probe_every)
            self._probed_from = None


class FixedDepth:
    """A depth the request (or the model's config) pins."""

    def __init__(self, depth: int):
        self.depth = depth
        self.histogram: collections.Counter[int] = collections.Counter()

    def choose(self) -> int:
        return self.depth

    def record(self, drafted: int, accepted: int, seconds: float | None) -> None:
        self.histogram[drafted] += 1
