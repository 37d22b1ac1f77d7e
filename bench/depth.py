"""The adaptive depth controller (runner/drafting/depth.py) against every fixed depth, in simulation.

Real runs on a shared 2-core machine swing by more than the few percent this controller's choices are worth, so its
rules are decided here first and checked by ``bench versus`` after. A simulated request emits 256 tokens; a round
of depth k takes the default pair's measured time (7.8 ms plain, 9.8 + 2.5 k ms drafting; SmolLM2's for the n-gram
rows), within +-10%; each draft is kept with its position's chance while the ones before it were. Eight requests per
runner (the first two warm it up), 30 seeds; tok/s against the best fixed depth on the same seeds.

Acceptance profiles: the pair's prose and input-grounded prompts (per-position conditional acceptance as fixed-depth
runs measured it), a weak drafter (plain decoding is best), a marginal one (plain and k = 1 about equal), SmolLM2's
n-gram lookup on prose-like and copying output, and regimes that switch (easy stretches keep 95%, hard ones 30%,
switching with chance 0.05 a round). A simulation: it has no late rounds, no pipeline restarts, no bursts within a
regime; it says which rule is better, not by how much a real run gains.
"""

from __future__ import annotations

import random
import statistics

from runner.drafting.depth import DepthController


def pair(k: int) -> float:
    return 0.0078 if k == 0 else 0.0098 + 0.0025 * k


def smollm2(k: int) -> float:
    return 0.057 if k == 0 else 0.075 + 0.008 * k


PROFILES = {
    "default pair, prose": ([0.75, 0.87, 0.88, 0.80, 0.85, 0.83], pair),
    "default pair, input-grounded": ([0.82, 0.85, 0.9, 0.9, 0.8, 0.8], pair),
    "a weak drafter": ([0.35, 0.5, 0.5, 0.5, 0.5, 0.5], pair),
    "a marginal drafter": ([0.55, 0.6, 0.6, 0.6, 0.6, 0.6], pair),
    "SmolLM2 n-gram, prose-like": ([0.6, 0.7, 0.7, 0.7, 0.7, 0.7], smollm2),
    "SmolLM2 n-gram, copying": ([0.9, 0.95, 0.95, 0.95, 0.9, 0.9], smollm2),
    "switching regimes": (None, pair),
}
SEEDS = 30
REQUESTS = 8
TOKENS = 256


def request(controller, rng: random.Random, acceptance, seconds, fixed: int | None) -> tuple[int, float]:
    emitted, elapsed, hard = 0, 0.0, False
    while emitted < TOKENS:
        k = fixed if fixed is not None else controller.choose()
        if acceptance is None:
            hard = hard != (rng.random() < 0.05)
            chances = [0.3 if hard else 0.95] * 6
        else:
            chances = acceptance
        kept = 0
        while kept < k and rng.random() < chances[kept]:
            kept += 1
        took = seconds(k) * rng.uniform(0.9, 1.1)
        emitted += kept + 1
        elapsed += took
        if fixed is None:
            controller.record(k, kept, took)
    return emitted, elapsed


def rate(seed: int, acceptance, seconds, fixed: int | None = None) -> float:
    rng = random.Random(seed)
    runner = DepthController(max_depth=6)
    tokens = elapsed = 0.0
    for i in range(REQUESTS):
        controller = runner.for_request()
        emitted, took = request(controller, rng, acceptance, seconds, fixed)
        controller.finish()
        if i >= 2:
            tokens, elapsed = tokens + emitted, elapsed + took
    return tokens / elapsed


def run() -> None:
    print(f"## adaptive depth, simulated: {SEEDS} seeds x {REQUESTS} requests of {TOKENS} tokens\n")
    print("| acceptance | best fixed depth | its tok/s | adaptive tok/s | adaptive vs best fixed |")
    print("| --- | --- | --- | --- | --- |")
    for name, (acceptance, seconds) in PROFILES.items():
        fixed = {k: statistics.mean(rate(s, acceptance, seconds, k) for s in range(SEEDS)) for k in range(7)}
        best = max(fixed, key=fixed.get)
        adaptive = statistics.mean(rate(s, acceptance, seconds) for s in range(SEEDS))
        print(f"| {name} | k = {best} | {fixed[best]:.1f} | {adaptive:.1f} | {adaptive / fixed[best]:.3f}x |")
    print()
