"""A model that thinks (issue #38): what keeping its reasoning apart costs, and a budget's end as forced drafts.

On ``models/reasoning`` (the 1.7M-parameter model that thinks in Qwen3's way, in-process, greedy):

- parse cost: the runner's split of each round into reasoning, text and tool calls (``runner.server.AnswerSplit``,
  ``common.reasoning.ReasoningSplitter``), timed over the rounds of real answers and set against the decode time
  of the same answers. The tiny model decodes far faster than any real one, so this is the worst case; the same
  split time is also set against SmolLM2-135M's decode time per token (a real model, and still a small one).
  Goal: < 1% of decode time.
- a budget's end: answers under a reasoning budget and a JSON schema, the end marker and the grammar's fixed
  tokens fed as certain drafts (forced) against sampled one round each (forcing off), alternated.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.speculation import after_first_token
from common.defaults import SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from runner.server import AnswerSplit

MODEL = Path(__file__).resolve().parents[1] / "models" / "reasoning"
QUESTIONS = [f"What is {a} plus {b}?" for a, b in ((12, 7), (3, 30), (41, 8), (25, 25), (9, 60), (70, 2))]
QUESTIONS += [f"Which is larger, {a} or {b}?" for a, b in ((12, 70), (33, 3), (48, 84))]
SCHEMA = {
    "type": "object",
    "properties": {"question": {"type": "string", "maxLength": 40}, "answer": {"type": "integer"}},
    "required": ["question", "answer"],
    "additionalProperties": False,
}
REPEATS = 3
SPLITS = 200  # times each answer's rounds are split again, for a time well above the clock's grain


def answers(engine: Engine, **fields) -> list[tuple]:
    """(prepared, rounds) of each question's greedy answer."""
    out = []
    for question in QUESTIONS:
        request = GenerationRequest(messages=(("user", question),), max_tokens=128, cache_prompt=False, **fields)
        prepared = engine.prepare(request)
        rounds = list(engine.generate(request))
        out.append((prepared, rounds))
    return out


def split_seconds(engine: Engine, answered: list[tuple]) -> float:
    """Seconds to split every answer's rounds once (the mean of SPLITS runs)."""
    started = time.perf_counter()
    for _ in range(SPLITS):
        for prepared, rounds in answered:
            split = AnswerSplit(prepared, engine.tokenizer)
            for r in rounds:
                split.feed(r)
    return (time.perf_counter() - started) / SPLITS


def smollm2_seconds_per_token() -> float:
    engine = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0))
    request = GenerationRequest(prompt="Once upon a time", max_tokens=128, ignore_eos=True, drafter="none")
    for _ in range(2):  # the first run warms up
        for last in engine.generate(request):
            pass
    tokens, seconds = after_first_token(last.stats)
    return seconds / tokens


def run() -> None:
    engine = Engine.load(MODEL, None, RunnerSettings(prompt_cache=0))
    answered = answers(engine, drafter="none")
    tokens = sum(r[-1].stats.generated_tokens for _, r in answered)
    decode = sum(r[-1].stats.decode_seconds for _, r in answered)
    split = split_seconds(engine, answered)
    reasoning = 0
    for prepared, rounds in answered:
        counted = AnswerSplit(prepared, engine.tokenizer)
        for r in rounds:
            counted.feed(r)
        reasoning += counted.reasoning_tokens
    per_token = split / tokens
    smol = smollm2_seconds_per_token()
    print(
        f"## reasoning: models/reasoning (1.7M parameters, {engine.target.compute_dtype}), {len(QUESTIONS)} "
        f"questions, greedy: {tokens} tokens, {reasoning} of them reasoning\n"
    )
    print("| what | per token | share of decode |")
    print("| --- | --- | --- |")
    print(f"| decode, models/reasoning | {decode / tokens * 1e3:.3f} ms | |")
    print(f"| split into reasoning / text / calls | {per_token * 1e6:.1f} us | {split / decode:.2%} |")
    print(f"| decode, SmolLM2-135M (for scale) | {smol * 1e3:.2f} ms | split: {per_token / smol:.3%} |")

    grammar = json.dumps({"json_schema": SCHEMA})
    rows: dict[str, list] = {}
    configs = {"forced (certain drafts)": True, "forcing off (one round each)": False}
    for budget in (4, 16):
        for label, forcing in configs.items():  # warm-up
            engine.grammars.forcing = forcing
            answers(engine, drafter="none", reasoning_budget=budget, grammar=grammar)
        for repeat in range(REPEATS):
            order = list(configs.items()) if repeat % 2 == 0 else list(configs.items())[::-1]
            for label, forcing in order:
                engine.grammars.forcing = forcing
                done = answers(engine, drafter="none", reasoning_budget=budget, grammar=grammar)
                row = rows.setdefault(f"{budget} | {label}", [0, 0.0, 0, 0])
                for _, r in done:
                    s = r[-1].stats
                    row[0] += s.generated_tokens
                    row[1] += s.decode_seconds
                    row[2] += s.rounds
                    row[3] += s.forced
        engine.grammars.forcing = True
    print(f"\nUnder a reasoning budget and a JSON schema ({REPEATS} alternated repeats):\n")
    print("| budget | decoding | tokens per round | forced per token | tok/s (whole answer) | vs forcing off |")
    print("| --- | --- | --- | --- | --- | --- |")
    for budget in (4, 16):
        off = rows[f"{budget} | forcing off (one round each)"]
        for label in configs:
            generated, seconds, rounds, forced = rows[f"{budget} | {label}"]
            rate = generated / seconds
            print(
                f"| {budget} | {label} | {generated / rounds:.2f} | {forced / generated:.2f} | {rate:.0f} | "
                f"{rate / (off[0] / off[1]):.2f}x |"
            )


if __name__ == "__main__":
    run()
