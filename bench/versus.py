"""Issue #40's ratios in one alternated run, on this machine: never slower than mlx-lm.

- plain decoding, ours (``Engine.generate``, drafter none) against mlx-lm's ``generate_step``, per model and
  prompt kind (``bench.speculation.table``: every configuration runs each prompt in turn, the order reversed
  every other prompt). Goal: >= 1.0x.
- the default (adaptive) decoder against the best of our plain and every fixed depth of its drafter, in the same
  table. Goal: >= 0.97x.
- prefill: our prompt tok/s (``prefill_seconds``, chunked as the runner chunks) against mlx-lm's
  ``generate_step`` up to its first token (its own 2048-token steps), at 200, 1,500 and 8,000 tokens, alternated.
  Goal: >= 1.0x.

The default pair decodes 256 tokens a prompt, SmolLM2-135M-Instruct (float32 on the CPU) up to 128; 2 prompts
of each kind.
- batching with a quantized KV cache (kv_bits 8): the rows one ``batch_memory`` admits against float's (goal
  >= 1.8x), 8 concurrent requests' tok/s batched at 8 bits against float (alternated), and whether each batched
  8-bit request's greedy tokens are its tokens alone.
- stacked projections (``runner.loading.fusion``): mlx-lm's ``generate_step`` on the target loaded with its q/k/v and gate/up
  projections stacked against the same checkpoint as mlx-lm ships it, alternated; and whether the tokens are the
  same. (No goal of its own: it is part of why item 1's ratio is what it is.)
Not here: constrained decoding against free decoding (item 4) is bench/structured.py's, the relay at 16 clients
(item 5) bench/front_door.py's.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step

from bench.speculation import as_mlx_lm_runs_it, ours, plain_rows, table
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.loading.load import load_model
from runner.request import GenerationRequest
from runner.worker import MlxWorker

PAIR_TOKENS = 256
SMOL_TOKENS = 128
PROMPTS_PER_KIND = 2
PREFILL_LENGTHS = (200, 1500, 8000)
PREFILL_REPEATS = 2


def decoding(label: str, engine: Engine, tokens: int, chat: bool, drafter: str, depths) -> list[str]:
    """Rows of the goals table for one model: plain vs mlx-lm, adaptive vs the best fixed choice (``drafter``:
    "model" or "ngram", at each of ``depths``)."""
    as_mlx_lm = as_mlx_lm_runs_it(engine)
    rows = plain_rows(engine, as_mlx_lm, tokens, chat)
    rows += [
        (f"ours, {drafter}, k = {k}", lambda p, k=k: ours(engine, p, tokens, chat, drafter=drafter, num_draft_tokens=k))
        for k in depths
    ]
    rows += [("ours, default (adaptive)", lambda p: ours(engine, p, tokens, chat))]
    results = table(label, engine, tokens, chat, rows, PROMPTS_PER_KIND)
    out = []
    for kind in results["ours, plain"]:
        plain = results["ours, plain"][kind].rate
        reference = results["mlx-lm generate_step"][kind].rate
        fixed = {
            name: r[kind].rate for name, r in results.items() if name.startswith("ours, ") and "adaptive" not in name
        }
        best = max(fixed, key=fixed.get)
        adaptive = results["ours, default (adaptive)"][kind].rate
        out.append(f"| {label}, {kind} | plain vs mlx-lm generate_step | {plain / reference:.2f}x | >= 1.0x |")
        out.append(
            f"| {label}, {kind} | default (adaptive) vs the best fixed ({best.removeprefix('ours, ')}) | "
            f"{adaptive / fixed[best]:.2f}x | >= 0.97x |"
        )
    return out


def prefill(label: str, engine: Engine, lengths) -> list[str]:
    """Our prompt tok/s against mlx-lm's at each length, alternated."""
    target, _ = as_mlx_lm_runs_it(engine)
    rng = np.random.default_rng(0)
    out = []
    for n in lengths:
        ids = [int(x) for x in rng.integers(100, 3000, n)]
        mine, theirs = [], []
        for repeat in range(PREFILL_REPEATS):
            for who in ("ours", "mlx-lm") if repeat % 2 == 0 else ("mlx-lm", "ours"):
                if who == "ours":
                    request = GenerationRequest(prompt_ids=tuple(ids), max_tokens=1, cache_prompt=False)
                    for last in engine.generate(request):
                        pass
                    mine.append(last.stats.prefill_seconds)
                else:
                    started = time.perf_counter()
                    for _ in generate_step(mx.array(ids), target, max_tokens=1):
                        break
                    theirs.append(time.perf_counter() - started)
        ratio = np.median(theirs) / np.median(mine)
        out.append(
            f"| {label}, {n}-token prompt | prefill vs mlx-lm ({n / np.median(mine):.0f} / "
            f"{n / np.median(theirs):.0f} tok/s) | {ratio:.2f}x | >= 1.0x |"
        )
    return out


FUSION_RUNS = 4


def fusion(label: str, folder, dtype: str, tokens: int) -> list[str]:
    """mlx-lm's generate_step over ``folder`` stacked (runner.loading.fusion) and apart, alternated: tok/s after the first token."""
    apart = load_model(folder, dtype, row_padding=False, fuse=False).model
    stacked = load_model(folder, dtype, row_padding=False).model
    ids = mx.array(list(range(100, 140)))

    def rate(model) -> tuple[float, list[int]]:
        out, start = [], None
        for token, _ in generate_step(ids, model, max_tokens=tokens):
            out.append(int(token))
            start = start or time.perf_counter()
        return (len(out) - 1) / (time.perf_counter() - start), out

    rate(apart), rate(stacked)  # warm-up
    ratios, same = [], True
    for run in range(FUSION_RUNS):
        order = (apart, stacked) if run % 2 == 0 else (stacked, apart)
        got = {id(model): rate(model) for model in order}
        ratios.append(got[id(stacked)][0] / got[id(apart)][0])
        same = same and got[id(stacked)][1] == got[id(apart)][1]
    return [
        f"| {label} ({dtype}), {tokens} tokens | mlx-lm generate_step, projections stacked vs apart (median of "
        f"{FUSION_RUNS}, {min(ratios):.2f}-{max(ratios):.2f}; same tokens: {'yes' if same else 'NO'}) | "
        f"{float(np.median(ratios)):.2f}x | (part of item 1) |"
    ]


KV_ROWS = 8
KV_TOKENS = 128
KV_PROMPTS = tuple(f"{p} {i}" for i, p in enumerate(("The for statement is", "A class definition is") * 4))


def _batched(engine: Engine, max_batch: int = KV_ROWS) -> tuple[float, list]:
    """``KV_ROWS`` concurrent greedy requests through a worker: (tok/s, each request's tokens)."""
    worker = MlxWorker(engine, max_queue=KV_ROWS, max_batch=max_batch)
    worker.start()
    try:
        started = time.perf_counter()
        jobs = [
            worker.submit(
                engine.prepare(
                    GenerationRequest(
                        prompt=p, max_tokens=KV_TOKENS, ignore_eos=True, cache_prompt=False, drafter="none"
                    )
                )
            )
            for p in KV_PROMPTS
        ]
        tokens = [[t for r in job.results() for t in r.token_ids] for job in jobs]
        return sum(map(len, tokens)) / (time.perf_counter() - started), tokens
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def kv_batching(label: str, engine: Engine) -> list[str]:
    """Issue #40 item 6: rows at one batch_memory, batched tok/s and tokens alone, 8-bit against float."""
    eight = Engine(engine.target, engine.draft, RunnerSettings(kv_bits=8, prompt_cache=0))
    floats = Engine(engine.target, engine.draft, RunnerSettings(prompt_cache=0))
    budget = floats.cache_cost.batch([1024] * 4)
    admitted = {
        name: max(n for n in range(1, 256) if e.cache_cost.batch([1024] * n) <= budget)
        for name, e in (("float", floats), ("8-bit", eight))
    }
    rates = {"float": [], "8-bit": [], "8-bit, one at a time": []}
    got = None
    for repeat in range(2):
        for name in rates if repeat % 2 == 0 else list(rates)[::-1]:
            rate, tokens = _batched(floats if name == "float" else eight, 1 if "one at" in name else KV_ROWS)
            rates[name].append(rate)
            if name == "8-bit":
                got = tokens
    alone = []
    for p in KV_PROMPTS:
        request = GenerationRequest(prompt=p, max_tokens=KV_TOKENS, ignore_eos=True, cache_prompt=False, drafter="none")
        alone.append([t for r in eight.generate(request) for t in r.token_ids])
    same = sum(a == b for a, b in zip(alone, got))
    ratio = np.median(rates["8-bit"]) / np.median(rates["float"])
    return [
        f"| {label}, {KV_ROWS} x 1,024-token rows | rows one batch_memory admits, 8-bit vs float "
        f"({admitted['8-bit']} / {admitted['float']}) | {admitted['8-bit'] / admitted['float']:.2f}x | >= 1.8x |",
        f"| {label}, {KV_ROWS} concurrent x {KV_TOKENS} tokens | batched tok/s, 8-bit vs float "
        f"({np.median(rates['8-bit']):.0f} / {np.median(rates['float']):.0f}) | {ratio:.2f}x | (batched, not one at a time) |",
        f"| {label}, {KV_ROWS} concurrent x {KV_TOKENS} tokens | 8-bit tok/s, batched vs one at a time (as before) "
        f"| {np.median(rates['8-bit']) / np.median(rates['8-bit, one at a time']):.2f}x | (batched, not one at a time) |",
        f"| {label}, {KV_ROWS} concurrent | batched 8-bit greedy tokens equal to each alone | {same} / {KV_ROWS} | all |",
    ]


def run() -> None:
    pair = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))
    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0))
    print(f"row padding: default pair {pair.target.row_padding}; SmolLM2 {smol.target.row_padding}\n")
    goals = decoding("default pair", pair, PAIR_TOKENS, False, "model", range(1, 7))
    goals += decoding("SmolLM2", smol, SMOL_TOKENS, True, "ngram", (1, 2, 4))
    goals += prefill("default pair", pair, PREFILL_LENGTHS)
    goals += prefill("SmolLM2", smol, PREFILL_LENGTHS[:2])
    goals += kv_batching("default pair", pair)
    goals += fusion("default pair's target", DEFAULT_TARGET, "float32", PAIR_TOKENS)
    goals += fusion("SmolLM2", SMOLLM2_DIR, "float32", 48)
    print("## versus: issue #40's goals, one run\n")
    print("| model, prompts | what | figure | goal |")
    print("| --- | --- | --- | --- |")
    for line in goals:
        print(line)
    print()


if __name__ == "__main__":
    run()
