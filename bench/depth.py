"""The adaptive depth controller (runner/drafting/depth.py) against every fixed depth, in simulation.

Real runs on a shared 2-core machine swing by more than the few percent this controller's choices are worth, so its
rules are tried here first and checked on real runs after - where one simulated well and did not carry over (a
learned prior weight, 2026-12-07: docs/design.md, "Adaptive depth"), real runs decide. A simulated request emits
256 tokens; a round of depth k takes the default pair's measured time (7.8 ms plain, 9.8 + 2.5 k ms drafting;
SmolLM2's for the n-gram rows), within +-10%; each draft is kept with its position's chance while the ones before it
were. Eight requests per runner (the first two warm it up), 30 seeds; tok/s against the best fixed depth on the same
seeds. A second table has the measured profiles on a runner as cold as bench versus has it (five requests, the
first not counted).

Acceptance profiles: the pair's prose and input-grounded prompts (per-position conditional acceptance as fixed-depth
runs measured it), the same measured again on 2026-12-07 with their own round times (k = 6 runs of bench.speculation's
prompts: each position's share kept of the rounds that reached it; each depth's median round), a weak drafter (plain
decoding is best), a marginal one (plain and k = 1 about equal), SmolLM2's n-gram lookup on prose-like and copying
output, regimes that switch within a request (easy stretches keep 95%, hard ones 30%, switching with chance 0.05 a
round), and a runner whose requests differ (every other one copies its input). Two costs measured on the pair: a
round that switches between plain decoding and drafting restarts the pipeline (half a plain round more), and the
measured profiles' requests start hard (their first 8 tokens' first draft kept 15% of the time). A simulation: it has
no late rounds and no bursts within a regime but those above; it says which rule is better, not by how much a real
run gains.
"""

from __future__ import annotations

import random
import statistics

from runner.drafting.depth import DepthController


def pair(k: int) -> float:
    return 0.0078 if k == 0 else 0.0098 + 0.0025 * k


def smollm2(k: int) -> float:
    return 0.057 if k == 0 else 0.075 + 0.008 * k


# The default pair, 2026-12-07, this Xeon: a round's median milliseconds at each depth (plain from pipelined rounds).
PAIR_PROSE_MS = (7.4, 12.25, 14.76, 17.98, 20.71, 22.74, 23.71)
PAIR_GROUNDED_MS = (7.4, 11.11, 14.4, 17.81, 19.34, 21.74, 24.43)
PAIR_PROSE = [0.724, 0.81, 0.738, 0.803, 0.776, 0.737]
PAIR_GROUNDED = [0.76, 0.804, 0.872, 0.824, 0.768, 0.952]
# The same pair on the AMD EPYC (2026-12-07, later; the next first draft queued with each verification): a round's
# median at each depth as the controller timed it, and the runner's per-position acceptance after 4 prompts x 6 runs.
PAIR_EPYC_MS = (5.24, 6.49, 8.79, 11.9, 13.65, 14.18, 15.11)
PAIR_EPYC = [0.76, 0.84, 0.77, 0.71, 0.81, 0.98]
MEASURED = (PAIR_PROSE, PAIR_GROUNDED, PAIR_EPYC)
# Their requests start hard: at k = 3, the first draft of a request's first 5 rounds was kept 15% of the time
# (7 prose and 3 grounded prompts, 2026-12-07), of its next 10 about 75%, and of the rest 80%.
HARD_START = 8  # tokens
HARD_START_ACCEPTANCE = 0.15
# A round from plain decoding to drafting or back restarts the pipeline: an isolated plain round on the pair took
# 9-14 ms against 6-7 ms in a run of them (docs/design.md).
SWITCH = 0.5  # of a plain round's time, added to such a round
COPYING = [0.92, 0.95, 0.95, 0.95, 0.9, 0.9]


PROFILES = {
    "default pair, prose": ([0.75, 0.87, 0.88, 0.80, 0.85, 0.83], pair),
    "default pair, input-grounded": ([0.82, 0.85, 0.9, 0.9, 0.8, 0.8], pair),
    "a weak drafter": ([0.35, 0.5, 0.5, 0.5, 0.5, 0.5], pair),
    "a marginal drafter": ([0.55, 0.6, 0.6, 0.6, 0.6, 0.6], pair),
    "SmolLM2 n-gram, prose-like": ([0.6, 0.7, 0.7, 0.7, 0.7, 0.7], smollm2),
    "SmolLM2 n-gram, copying": ([0.9, 0.95, 0.95, 0.95, 0.9, 0.9], smollm2),
    "switching regimes": (None, pair),
    "default pair, prose, measured 2026-12-07": (PAIR_PROSE, lambda k: PAIR_PROSE_MS[k] / 1000),
    "default pair, input-grounded, measured 2026-12-07": (PAIR_GROUNDED, lambda k: PAIR_GROUNDED_MS[k] / 1000),
    "default pair, measured 2026-12-07 on the EPYC": (PAIR_EPYC, lambda k: PAIR_EPYC_MS[k] / 1000),
    "requests that differ: every other one copies": (([0.5] + [0.6] * 5, COPYING), pair),
}
SEEDS = 30
REQUESTS = 8
TOKENS = 256


def request(controller, rng: random.Random, acceptance, seconds, fixed: int | None) -> tuple[int, float]:
    emitted, elapsed, hard, previous = 0, 0.0, False, None
    while emitted < TOKENS:
        k = fixed if fixed is not None else controller.choose()
        if acceptance is None:  # switching regimes
            hard = hard != (rng.random() < 0.05)
            chances = [0.3 if hard else 0.95] * 6
        elif emitted < HARD_START and acceptance in MEASURED:  # the measured runs' first rounds
            chances = [HARD_START_ACCEPTANCE] + acceptance[1:]
        else:
            chances = acceptance
        kept = 0
        while kept < k and rng.random() < chances[kept]:
            kept += 1
        took = seconds(k) * rng.uniform(0.9, 1.1)
        if previous is not None and (k == 0) != (previous == 0):  # the pipeline restarts
            took += SWITCH * seconds(0)
        previous = k
        emitted += kept + 1
        elapsed += took
        if fixed is None:
            controller.record(k, kept, took)
    return emitted, elapsed


def rate(seed: int, acceptance, seconds, fixed: int | None = None, requests: int = REQUESTS, warm: int = 2) -> float:
    """tok/s of a runner's ``requests`` requests after its first ``warm``, one seed."""
    rng = random.Random(seed)
    runner = DepthController(max_depth=6)
    tokens = elapsed = 0.0
    for i in range(requests):
        controller = runner.for_request()
        # a tuple: the requests take its profiles in turn
        chances = acceptance[i % len(acceptance)] if isinstance(acceptance, tuple) else acceptance
        emitted, took = request(controller, rng, chances, seconds, fixed)
        controller.finish()
        if i >= warm:
            tokens, elapsed = tokens + emitted, elapsed + took
    return tokens / elapsed


def table(title: str, profiles, requests: int, warm: int) -> None:
    print(f"## {title}\n")
    print("| acceptance | best fixed depth | its tok/s | adaptive tok/s | adaptive vs best fixed |")
    print("| --- | --- | --- | --- | --- |")
    for name in profiles:
        acceptance, seconds = PROFILES[name]
        fixed = {
            k: statistics.mean(rate(s, acceptance, seconds, k, requests, warm) for s in range(SEEDS)) for k in range(7)
        }
        best = max(fixed, key=fixed.get)
        adaptive = statistics.mean(rate(s, acceptance, seconds, None, requests, warm) for s in range(SEEDS))
        print(f"| {name} | k = {best} | {fixed[best]:.1f} | {adaptive:.1f} | {adaptive / fixed[best]:.3f}x |")
    print()


def run() -> None:
    table(f"adaptive depth, simulated: {SEEDS} seeds x {REQUESTS} requests of {TOKENS} tokens", PROFILES, REQUESTS, 2)
    # bench versus measures a runner that has served one request (its warm-up) before the four it times
    table(
        f"adaptive depth, simulated, a cold runner as bench versus has it: {SEEDS} seeds x 5 requests, the first not "
        "counted",
        [name for name in PROFILES if "measured" in name],
        5,
        1,
    )
