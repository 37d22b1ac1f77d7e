"""MTP drafting (runner/drafting/mtp.py) against plain decoding, on the tiny checkpoints of models/train_mtp.py.

Random weights: their MTP layers' drafts are almost never kept, so this measures what drafting with a layer that
is always wrong costs; the ``*_trained`` copies' layers learnt the answer to this very prompt (overfit), so they
show the other end, drafts nearly always kept. Neither says anything about a real model's acceptance: at hidden
size 64 the MTP layer costs about as much as the target, where in a real model it is one layer of many.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest

MTP_DIR = Path(__file__).resolve().parents[1] / "models" / "mtp"
PROMPT = "The for statement is used to iterate over the elements of a sequence"  # what the *_trained layers learnt
TOKENS = 64
REPEATS = 5
MODELS = ("deepseek_v3", "qwen3_5", "deepseek_v3_trained", "qwen3_5_trained")
DECODERS = {"plain": {"drafter": "none"}, "mtp, adaptive": {"drafter": "mtp"}, "mtp, k = 2": {"num_draft_tokens": 2}}


def decode(engine: Engine, fields: dict) -> tuple[float, int, int]:
    """tok/s after the first round (decoding, not prefill), drafted and accepted."""
    request = GenerationRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False, **fields)
    tokens, started, last = 0, None, None
    for round_ in engine.generate(request):
        if started is None:
            started = time.perf_counter()
        else:
            tokens += len(round_.token_ids)
        last = round_
    elapsed = time.perf_counter() - started
    return tokens / elapsed, last.stats.drafted, last.stats.accepted


def run() -> None:
    if not (MTP_DIR / "qwen3_5_trained").is_dir():
        print("models/mtp is missing: make mtp-model\n")
        return
    print(f"## MTP drafting: tiny models (models/mtp, float32), {TOKENS} greedy tokens, {REPEATS} alternated runs\n")
    print(
        "Random weights say nothing about a real model's acceptance: the random layers' drafts are never kept, "
        "the `*_trained` layers were overfit to this very prompt, and at width 64 the MTP layer costs about as "
        "much as the whole target.\n"
    )
    print("| model | decoder | tok/s (median) | vs plain | acceptance |")
    print("| --- | --- | --- | --- | --- |")
    for name in MODELS:
        engine = Engine.load(MTP_DIR / name, settings=RunnerSettings(dtype="float32"))
        engine.warm_up()
        runs = {decoder: [] for decoder in DECODERS}
        for _ in range(REPEATS):
            for decoder, fields in DECODERS.items():
                runs[decoder].append(decode(engine, fields))
        plain = statistics.median(r[0] for r in runs["plain"])
        for decoder, results in runs.items():
            speed = statistics.median(r[0] for r in results)
            drafted, accepted = results[-1][1:]
            acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
            print(f"| {name} | {decoder} | {speed:.0f} | {speed / plain:.2f}x | {acceptance} |")
    print()
