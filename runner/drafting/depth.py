"""The draft depth: how many tokens to draft in the next round, learned as the runner goes.

The ``DepthController`` keeps
- the acceptance at each draft position: a_i, the chance that draft i is kept
  when every draft before it was. This is a property of the request (one that
  copies from its input keeps nearly every n-gram draft, prose keeps few), so
  each request learns its own (``for_request``), starting from the first
  position's acceptance the runner's requests saw so far (``finish`` folds each
  one in). Each position keeps decayed counts of the rounds that reached it and
  kept its draft (weight ``SMOOTHING`` for the newest), and is expected kept
  (kept + a_(i-1)) / (reached + 1): a position this request has seldom or never
  reached leans on the one before it. Acceptance comes in runs (text being
  copied goes on being copied), so after a few rounds at depth 2 that keep
  everything, depth 4 is expected to keep nearly everything too. Positions
  carried over from other requests, or averaged without their counts, held deep
  positions at what probes of prose had seen, and a request that copied its
  input stayed at depth 2 where 4 was 1.1x faster (docs/design.md);
- the wall time of a round at each depth k (draft, verify, rewind and the host's
  work on what it emitted), the median of its last ``SAMPLES`` rounds: a
  property of the runner and its machine, shared by every request per runner
  and drafter. (A moving average, nudged by every late round, left pair prose
  at 0.90x the best fixed depth; the median 0.93x, one run each.)

A round of depth k emits E(k) = 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens on
average, so it picks the k with the most expected tokens per second,
E(k) / T(k), among the depths it has timed and the one just deeper than the
deepest timed - k = 0 (plain decoding) when no drafting pays. It climbs as far
as the evidence carries it, without waiting for a probe:
- a position no round has reached yet is expected to be kept as often as the
  one before it, not at an even chance;
- the time of an untimed depth is extrapolated along the line through the
  timed ones (least squares), and never below the deepest timed depth's;
- a drafted depth is expected to take at least as long as every shallower
  drafted one (it does their work and more: a median that says less is old).
(Expecting an unreached position kept at an even chance, and trying only timed
depths, kept a request that copies its input shallow at high acceptance where
deeper rounds pay; docs/design.md, "Adaptive depth", has the figures.) Now and
then it tries a neighbour of the best depth (one
deeper, then one shallower, in turn), so a depth that starts to pay is found
and one that stops paying is left; a depth not timed for longer than the
longest probe interval has its times dropped for the next round's. A probe costs: the neighbour is slower than
the best, or it would be the best. So the interval backs off: it starts at
``probe_every`` rounds, doubles after each probe that leaves the best depth
where it was, up to ``max_probe_every``, and falls back to ``probe_every`` as
soon as the best depth changes (by a probe, or because its acceptance moved).
From plain decoding (k = 0) it does not back off: a probe at k = 1 costs
little (one forward pass of two tokens, about the price of one), and the
output may start copying at any moment (and a deeper round than k = 1 may pay
where k = 1 cannot: a small model's verification of three tokens costs what
two do). From a drafting depth, a neighbour that could not win is not
probed (``plausible``): a shallower one whose expected rate is more than
``PROBE_SLACK`` behind the best depth's (only its time can be out of date), a
deeper one that would be that far behind even with its new positions all kept;
a time older than ``STALE_FOR_PROBES`` longest intervals rules nothing out. On
the EPYC (2026-12-07), where k = 1 was 1.4x plain decoding, every other probe
went to plain decoding and cost three rounds that restart the pipeline.
Dropping to a shallower depth needs no probe: the best depth's own rounds
keep the acceptance of its positions current.

Wall times on a shared machine are noisy, and the noise is one-sided: a round
the OS delays looks slow. So a round counts for at most ``SPIKE`` times its
depth's time (one late round does not make a depth look slow for the many
rounds until it is tried again). Among the depths expected within ``MARGIN`` of
the fastest it takes the deepest: a deeper round sees more positions, so its
estimates stay current, where a shallow one leaves the deeper positions to
probes and priors, which underestimated them (the default pair's prose sat at
k = 1-2 where k = 3-4 were as fast). Held at plain decoding, a request sees
no drafts: what its rounds said of its acceptance fades toward its prior (the
runner's typical request) by the same decay as a round's, so a run of rejected
drafts does not keep it plain until probes happen to be kept (a simulation of
the pair's prose: 0.94x the best fixed depth before, 0.97x after; bench
versus has the measured figures). A round that goes from plain decoding to drafting, or
back, is not timed: it pays for the pipeline (a plain round after a drafted one
starts it, a drafted round after plain ones first reads the token queued), which
the depth's own rounds do not. Timed, an isolated plain round on the pair took
9-14 ms against 6-7 ms in a run of them, and plain decoding looked slower than
it is. So a probe across that line runs two rounds, and only the second is
timed - but a probe from plain decoding whose draft was not kept stops after
one (at no depth could it pay), so where drafting does not pay, probing costs
what it did. Greedy output does not depend on
the depth; a seeded sampling request pins k instead, so that its samples do
not depend on timing.
"""

from __future__ import annotations

import collections
import math
import statistics

DEFAULT_MAX_DEPTH = 6
# The weight of the newest round in a position's decayed counts. 0.1 against 0.2 (2026-12-07, this Xeon, the two
# alternated in one table, each run against the best of k = 2-4): the pair's prose 0.971x against 0.956x the best
# fixed depth over 10 runs (1.011x / 0.989x over 6 runs before), grounded 1.000x / 1.002x (0.998x / 0.986x); SmolLM2's
# n-gram 1.007x / 1.000x and 1.008x / 0.999x (3 runs). At 0.2 (about five rounds of memory) two rejected drafts
# in a row could put a request keeping 72% at plain decoding; acceptance on the pair is only mildly bursty.
SMOOTHING = 0.1
REQUEST_SMOOTHING = 0.25  # weight of the last request in the first position's acceptance a request starts from
PRIOR_ACCEPTANCE = 0.5  # the first position's, before any round
PRIOR_WEIGHT = 1.0  # rounds' worth of evidence in a position's prior (the runner's, or the position before it)
PROBE_EVERY = 10
MAX_PROBE_EVERY = 80
SPIKE = 1.5  # a round counts for at most this times its depth's time
SAMPLES = 9  # round times kept per depth; the median of them is its time
MARGIN = 0.02  # depths expected within this of the fastest count as as fast (the deepest of them is taken)
# A neighbour is probed only if it could plausibly be the best: a shallower one expected within this of the best
# depth's rate (only its time can be out of date: the best depth's rounds keep its positions current), a deeper one
# within this with its new positions all kept. Skipped probes back off as lost ones do.
PROBE_SLACK = 0.15
STALE_FOR_PROBES = 4  # longest probe intervals after which a neighbour's time no longer rules a probe of it out


def _logit(p: float) -> float:
    p = min(max(p, 0.02), 0.98)
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


class DepthController:
    def __init__(
        self,
        max_depth: int = DEFAULT_MAX_DEPTH,
        start: int = 1,
        probe_every: int = PROBE_EVERY,
        max_probe_every: int = MAX_PROBE_EVERY,
        smoothing: float = SMOOTHING,
        one_pass: bool = False,
    ):
        self.max_depth = max_depth
        # Whether the drafter proposes any depth in one pass (runner.drafting.block): a drafted round's time is then one
        # draft pass plus a verification that grows with k, not k drafter steps (predicted_seconds).
        self.one_pass = one_pass
        self.start = min(start, max_depth)
        self.probe_every = probe_every
        self.max_probe_every = max(max_probe_every, probe_every)
        self.interval = probe_every  # rounds between probes now
        self._since_probe = 0
        self._probed_from: int | None = None  # the best depth when the pending probe was chosen
        self._last_best: int | None = None  # the best depth the last choice saw (probes back off while it stays)
        self.smoothing = smoothing
        # Per position (index 0 is a_1): decayed counts of the rounds that reached it, and of those that kept it.
        self.seen = [0.0] * max_depth
        self.kept = [0.0] * max_depth
        # Per position, the request's rounds that reached it and kept it, undecayed: what ``finish`` tells the runner.
        self.reached = [0] * max_depth
        self.kept_in_all = [0] * max_depth
        # What a typical request on this runner keeps at each position (None: no request reached it yet); a
        # request's controller holds its runner's as it was when the request began.
        self.profile: list[float | None] = [PRIOR_ACCEPTANCE] + [None] * (max_depth - 1)
        self.seconds: dict[int, float] = {}  # depth -> a round's seconds: the median of its recent rounds
        self.samples: dict[int, collections.deque] = {}  # depth -> its last SAMPLES round times
        self.timed_at: dict[int, int] = {}  # depth -> the round it was last timed in
        self.rounds = 0
        self.runner: DepthController | None = None  # for a request's controller (for_request): its runner's
        self._probe_up = True
        self._previous: int | None = None  # the depth of the last round recorded
        self._again: int | None = None  # a probe's depth, for its second round (the one that is timed)
        self.histogram: collections.Counter[int] = collections.Counter()

    @property
    def acceptance(self) -> list[float]:
        """a_1..a_max as expected now: each position's counts, with ``PRIOR_WEIGHT`` rounds' worth of its prior.
        a_1's prior is the runner's profile; a deeper position's is the profile's there, shifted in log-odds by as
        much as this request's position before it differs from the profile's (a request that keeps more than
        the typical one at position i - 1 is expected to keep more at i too), or, where no request reached it,
        the position before it."""
        out: list[float] = []
        for i, (seen, kept) in enumerate(zip(self.seen, self.kept)):
            here, before = self.profile[i], self.profile[i - 1] if i else None
            if i == 0:
                prior = here
            elif here is None or before is None:
                prior = out[-1]
            else:
                prior = _sigmoid(_logit(here) + _logit(out[-1]) - _logit(before))
            out.append((kept + PRIOR_WEIGHT * prior) / (seen + PRIOR_WEIGHT))
        return out

    def expected_tokens(self, depth: int, acceptance: list[float] | None = None) -> float:
        """E(depth), from ``acceptance`` (``self.acceptance`` when not given: a caller comparing depths passes it
        once)."""
        total, kept = 1.0, 1.0
        for a in (self.acceptance if acceptance is None else acceptance)[:depth]:
            kept *= a
            total += kept
        return total

    def predicted_seconds(self, depth: int) -> float | None:
        """A round's seconds at ``depth``: the median of its recent rounds once timed; else the least-squares line
        through the timed depths there (slope at least 0), and at least the deepest timed depth's. None before two
        depths are timed. A drafted depth takes at least as long as every shallower drafted depth: it does all
        their work and more, and where its median says less, its rounds are old or were lucky (the pair's head on
        the EPYC, 2026-12-07: k = 4 at 12.8 ms against k = 3 at 17.1, which sent requests to k = 4)."""
        seconds = self._timed_or_line(depth)
        if seconds is None or depth == 0:
            return seconds
        return max([seconds, *(t for k, t in self.seconds.items() if 0 < k < depth)])

    def _timed_or_line(self, depth: int) -> float | None:
        if depth in self.seconds:
            return self.seconds[depth]
        if len(self.seconds) < 2:
            return None
        timed = self.seconds
        if self.one_pass and depth > 0:
            # A one-pass drafter's round: its draft pass costs the same at every depth and plain rounds never pay
            # it, so the line runs through the drafted depths only; with one of them timed, a deeper round is
            # expected to take as long (the verification's growth is what the next probe measures).
            drafted = {k: t for k, t in timed.items() if k > 0}
            if len(drafted) == 1:
                return next(iter(drafted.values()))
            timed = drafted or timed
        n = len(timed)
        mean_k = sum(timed) / n
        mean_t = sum(timed.values()) / n
        spread = sum((k - mean_k) ** 2 for k in timed)
        slope = max(0.0, sum((k - mean_k) * (t - mean_t) for k, t in timed.items()) / spread)
        deepest = max(k for k in timed if k < depth) if min(timed) < depth else None
        line = mean_t + slope * (depth - mean_k)
        return max(line, timed[deepest]) if deepest is not None else line

    def rate(self, depth: int, acceptance: list[float] | None = None) -> float:
        """Expected tokens per second at ``depth`` (0 when its time is unknown)."""
        seconds = self.predicted_seconds(depth)
        return self.expected_tokens(depth, acceptance) / seconds if seconds else 0.0

    def best(self) -> int:
        """The deepest of the depths expected within ``MARGIN`` of the fastest (see the module's docstring)."""
        if not self.seconds:
            return self.start
        candidates = set(self.seconds)
        if len(self.seconds) >= 2:
            candidates.add(min(max(self.seconds) + 1, self.max_depth))  # one deeper than the deepest timed
        acceptance = self.acceptance  # once for every candidate
        rates = {depth: self.rate(depth, acceptance) for depth in candidates}
        fastest = max(rates.values())
        return max(depth for depth, rate in rates.items() if (1 + MARGIN) * rate >= fastest)

    def for_request(self) -> DepthController:
        """The controller of one request. Round times are the runner's (shared, and kept current by every
        request); the acceptance is the request's own, its first position starting from what requests on this
        runner kept (``finish`` folds each request's in, a ``REQUEST_SMOOTHING`` step per request)."""
        own = DepthController(
            self.max_depth, self.start, self.probe_every, self.max_probe_every, self.smoothing, self.one_pass
        )
        own.profile = self.profile.copy()
        own.seconds, own.samples, own.timed_at = self.seconds, self.samples, self.timed_at
        own.histogram = self.histogram
        own.runner = self
        return own

    def finish(self) -> None:
        """A request's controller: its request ended; what it kept (at each position, the share of its rounds that
        reached it) moves the runner's starting acceptance."""
        runner, self.runner = self.runner, None
        if runner is None:
            return
        for i, (reached, kept) in enumerate(zip(self.reached, self.kept_in_all)):
            if reached:  # evidence of its own, not only its prior: the share of its rounds there that kept it
                a, was = kept / reached, runner.profile[i]
                runner.profile[i] = a if was is None else was + REQUEST_SMOOTHING * (a - was)

    @property
    def clock(self) -> int:
        """Rounds run on the runner (a request's controller counts its runner's)."""
        return self.runner.rounds if self.runner is not None else self.rounds

    def choose(self) -> int:
        """The depth for the next round."""
        self.rounds += 1
        if self.runner is not None:
            self.runner.rounds += 1  # the clock the shared round times are dated by
        best = self.best()
        if len(self.seconds) < 2 and self.rounds > 1:
            # Time plain decoding and the starting depth before trusting either.
            return 0 if 0 not in self.seconds else self.start
        if best != self._last_best:  # the best depth moved: look around it at the base rate again
            self._last_best, self.interval = best, self.probe_every
        if self._again is not None:  # a probe's second round: the first paid for the change of depth
            again, self._again = self._again, None
            return again
        self._since_probe += 1
        if self._since_probe >= self.interval:
            self._since_probe = 0
            self._probe_up = not self._probe_up
            up, down = min(best + 1, self.max_depth), max(best - 1, 0)
            turn = (up, down) if self._probe_up else (down, up)
            probe = next((k for k in turn if k != best and self.plausible(k, best)), None)
            if probe is None:  # no neighbour could win: as a probe that lost
                self.interval = min(2 * self.interval, self.max_probe_every)
                return best
            self._probed_from = best
            if (probe == 0) != (best == 0):  # between plain and drafting: its first round is not timed
                self._again = probe
            return probe
        return best

    def plausible(self, probe: int, best: int) -> bool:
        """Whether ``probe``, a neighbour of ``best``, could be the best depth: within ``PROBE_SLACK`` of its rate, a
        deeper neighbour with its new positions all kept. A probe that cannot win costs and teaches nothing the best
        depth's own rounds do not: on the EPYC (2026-12-07) a probe of plain decoding from k = 1 cost three rounds
        that restart the pipeline, where k = 1 was 1.4x plain (docs/design.md, "Adaptive depth")."""
        if best == 0 or self.predicted_seconds(probe) is None or self.predicted_seconds(best) is None:
            return True  # from plain decoding a probe always runs (see the module's docstring)
        if self.clock - self.timed_at.get(probe, self.clock) > STALE_FOR_PROBES * self.max_probe_every:
            return True  # its time is too old to rule it out (the machine, or what else it runs, may have changed)
        acceptance = self.acceptance
        hoped = acceptance[:best] + [1.0] * (probe - best) if probe > best else acceptance
        return (1 + PROBE_SLACK) * self.rate(probe, hoped) >= self.rate(best, acceptance)

    def record(self, drafted: int, accepted: int, seconds: float | None) -> None:
        """A round drafted ``drafted`` tokens (its depth), kept ``accepted`` and took ``seconds`` (None: not
        timed, e.g. a request's first round, which carries one-off costs)."""
        self.histogram[drafted] += 1
        if self._previous is not None and (drafted == 0) != (self._previous == 0):
            seconds = None  # from plain decoding to drafting or back: the round pays for restarting the pipeline
        self._previous = drafted
        w = self.smoothing
        reached = min(drafted, accepted + 1)  # positions the verification reached
        for i in range(reached):
            self.seen[i] = (1 - w) * self.seen[i] + 1.0
            self.kept[i] = (1 - w) * self.kept[i] + (1.0 if i < accepted else 0.0)
            self.reached[i] += 1
            self.kept_in_all[i] += i < accepted
        if drafted == 0 and self._probed_from is None:  # held at plain decoding (not probing it): it sees no
            # draft, and what this request's rounds said fades toward the prior
            for i in range(self.max_depth):
                self.seen[i] *= 1 - w
                self.kept[i] *= 1 - w
        if seconds is not None:
            samples = self.samples.setdefault(drafted, collections.deque(maxlen=SAMPLES))
            if samples and self.clock - self.timed_at.get(drafted, 0) > self.max_probe_every:
                samples.clear()  # not timed for longer than the longest probe interval: out of date
            if not samples:  # a depth's first round: late by at most SPIKE times what the line expects
                expected = self.predicted_seconds(drafted) if drafted not in self.seconds else None
                samples.append(seconds if expected is None else min(seconds, SPIKE * expected))
            else:
                samples.append(min(seconds, SPIKE * self.seconds[drafted]))
            self.seconds[drafted] = statistics.median(samples)
            self.timed_at[drafted] = self.clock
        if self._again and accepted == 0:  # a probe from plain decoding whose draft was not kept: no second
            self._again = None  # round (nothing at that depth could beat plain decoding without its drafts)
        if self._probed_from is not None and self._again is None:  # after a probe's last round
            if self.best() == self._probed_from > 0:  # the probe lost: wait longer before the next one
                self.interval = min(2 * self.interval, self.max_probe_every)
            self._probed_from = None


class FixedDepth:
    """A depth the request (or the model's config) pins."""

    def __init__(self, depth: int):
        self.depth = depth
        self.histogram: collections.Counter[int] = collections.Counter()

    def finish(self) -> None:
        pass

    def choose(self) -> int:
        return self.depth

    def record(self, drafted: int, accepted: int, seconds: float | None) -> None:
        self.histogram[drafted] += 1
