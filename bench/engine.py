"""Decode speed on the default pair: our loop (plain and k = 1..6) vs mlx-lm's own generators."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from runner.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from runner.engine import Engine, GenerationRequest

PROMPTS = (
    "The for statement is used to iterate over the elements of a sequence",
    "Assignment statements are used to (re-)bind names to values",
    "A class definition defines a class object",
)
TOKENS = 512


def ours(engine: Engine, k: int) -> tuple[float, float]:
    generated = seconds = drafted = accepted = 0
    for prompt in PROMPTS:
        for last in engine.generate(GenerationRequest(prompt=prompt, max_tokens=TOKENS, num_draft_tokens=k, ignore_eos=True)):
            pass
        s = last.stats
        generated += s.generated_tokens
        seconds += s.decode_seconds
        drafted += s.drafted
        accepted += s.accepted
    return generated / seconds, (accepted / drafted if drafted else float("nan"))


def mlx_lm(engine: Engine, k: int) -> tuple[float, float]:
    """mlx-lm's generators on the same (already loaded) models; timed from the first token."""
    generated = drafted_hits = 0
    seconds = 0.0
    for prompt in PROMPTS:
        ids = mx.array(engine.tokenizer.encode(prompt))
        if k == 0:
            steps = generate_step(ids, engine.target.model, max_tokens=TOKENS)
        else:
            steps = speculative_generate_step(ids, engine.target.model, engine.draft.model,
                                              num_draft_tokens=k, max_tokens=TOKENS)
        start = None
        for n, item in enumerate(steps):
            if start is None:
                start = time.perf_counter()
            if k and item[2]:
                drafted_hits += 1
            generated += 1
        seconds += time.perf_counter() - start
        generated -= 1  # the first token is the prefill's
    rate = generated / seconds
    return rate, (drafted_hits / (generated + len(PROMPTS)) if k else float("nan"))


def run() -> None:
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    ours(engine, 0)  # warm-up
    plain, _ = ours(engine, 0)
    reference_plain, _ = mlx_lm(engine, 0)
    print(f"## engine: {len(PROMPTS)} prompts x {TOKENS} tokens, greedy, default pair\n")
    print("| decoder | k | tok/s | vs our plain | acceptance (ours) / drafted share of tokens (mlx-lm) |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| ours, plain | 0 | {plain:.0f} | 1.00x | - |")
    print(f"| mlx-lm generate_step | 0 | {reference_plain:.0f} | {reference_plain / plain:.2f}x | - |")
    for k in range(1, 7):
        rate, acceptance = ours(engine, k)
        print(f"| ours, speculative | {k} | {rate:.0f} | {rate / plain:.2f}x | {acceptance:.2f} |")
    for k in range(1, 7):
        rate, share = mlx_lm(engine, k)
        print(f"| mlx-lm speculative_generate_step | {k} | {rate:.0f} | {rate / plain:.2f}x | {share:.2f} |")
    print()
