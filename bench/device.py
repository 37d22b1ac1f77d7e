"""The measures a GPU decides: ``python -m bench.device PART [--quick]``, run by bench/device.sh.

Every speed figure before this came from a shared 2-core CPU, where a forward
pass of one token costs what two cost, three rows cost like six and a batched
step is compute-bound. That decided: a batch does not speculate, deep drafts
rarely pay, one-row products are padded to two on the CPU. On a GPU a decode
step is bound by memory bandwidth and kernel launches, so those may flip. The
parts, each printing Markdown tables:

- ``env``: the device and backend MLX serves on, its memory, the versions.
- ``forward``: one forward pass of B rows x T tokens over a 256-token cache,
  for the default pair's target and SmolLM2, as mlx-lm's layers run it. Row
  T = k + 1 is what a verify pass of k drafts costs; B = 1 vs B = 2 at T = 1 is
  what one-row padding trades; a batch of B verifying k drafts costs
  (B, k + 1) against (B, 1) for plain batched decoding.
- ``memory``: one long speculative generation with the release rule on and
  off, in a fresh process each: MLX's active, pool and peak bytes, the
  process's RSS and, on an NVIDIA GPU, what ``nvidia-smi`` says it holds.
- ``new_shapes``: one prompt decoded twice, plainly and speculating, with
  runner.loading.attention's rule on and off, in a fresh process each: ms per round
  the first time (every cache length new) and the second (MLX's per-shape
  caches warm). Without the rule, the first pass paid ~60 ms a round on an
  H200 for cuDNN's per-shape attention plans.
- ``prefill``: the default pair's prompt tok/s at each chunk cap against mlx-lm's, which decides the
  GPU's ``prefill_chunk`` (2048 there, 256 on the CPU).
- ``speculation``, ``batching``, ``prompt_cache``: bench/ modules of those
  names at the GPU's sizes (deeper drafts, up to 64 clients), or at small sizes
  with ``--quick`` (the CPU run that keeps this script tested).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

QUICK = "--quick" in sys.argv
# --focus: the sizes that fit in what is left of a lease (a few minutes): fewer shapes, depths and prompts.
FOCUS = "--focus" in sys.argv


def env() -> None:
    from importlib import metadata

    import mlx.core as mx

    from runner.platform import describe

    print("## device\n")
    print("| what | value |\n| --- | --- |")
    print(f"| serving on | {describe()} |")
    for key, value in sorted(mx.device_info().items()):
        print(f"| mx.device_info {key} | {value} |")
    print(f"| mx.get_memory_limit | {mx.get_memory_limit() / 2**30:.1f} GiB |")
    for name in ("mlx", "mlx-cuda-13", "mlx-cpu", "mlx-lm", "grpcio", "protobuf", "transformers"):
        try:
            print(f"| {name} | {metadata.version(name)} |")
        except metadata.PackageNotFoundError:
            pass
    print(f"| python | {sys.version.split()[0]} |")
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        print(f"| nvidia-smi | {smi.stdout.strip()} |")
    except (OSError, subprocess.TimeoutExpired):
        pass
    print()


def _time_pass(model, cache, tokens, repeats: int) -> tuple[float, float]:
    """(median, first): seconds of one forward pass of ``tokens`` over ``cache``, the cache trimmed back after
    each; the first pass of a new shape pays for compiling its kernels."""
    import mlx.core as mx
    from mlx_lm.models.cache import trim_prompt_cache

    width = tokens.shape[1]
    times, first = [], 0.0
    for i in range(repeats + 2):
        start = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        elapsed = time.perf_counter() - start
        trim_prompt_cache(cache, width)
        if i == 0:
            first = elapsed
        elif i >= 2:  # two warm-ups: kernels of a new shape are compiled on first use
            times.append(elapsed)
    times.sort()
    return times[len(times) // 2], first


def forward() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from common.defaults import DEFAULT_TARGET, SMOLLM2_DIR
    from runner.loading.load import load_model
    from runner.platform import auto_dtype

    batches = (1, 2, 4) if QUICK else (1, 16, 64) if FOCUS else (1, 2, 4, 8, 16, 32, 64)
    widths = (1, 2, 3) if QUICK else (1, 3, 5) if FOCUS else (1, 2, 3, 4, 5, 7, 9, 13)
    repeats = 3 if QUICK else 10 if FOCUS else 15
    context = 64 if QUICK else 256
    models = (("default pair's target", DEFAULT_TARGET), ("SmolLM2-135M-Instruct", SMOLLM2_DIR))
    for label, folder in models[1:] if FOCUS else models:
        dtype = auto_dtype()
        loaded = load_model(folder, dtype, row_padding=False)
        model, vocab = loaded.model, loaded.vocab_size
        print(f"## forward pass: {label} ({loaded.compute_dtype}), {context}-token cache, ms per pass\n")
        print(
            "| rows B | "
            + " | ".join(f"T = {t}" for t in widths)
            + " | T = 3 vs T = 1 | per row at T = 1 | first pass at T = 1 |"
        )
        print("| --- | " + " | ".join("---" for _ in widths) + " | --- | --- | --- |")
        for b in batches:
            cache = make_prompt_cache(model)
            mx.eval(model(mx.random.randint(0, vocab, (b, context)), cache=cache))
            timed = {t: _time_pass(model, cache, mx.random.randint(0, vocab, (b, t)), repeats) for t in widths}
            row = {t: median for t, (median, _) in timed.items()}
            cells = " | ".join(f"{row[t] * 1000:.2f}" for t in widths)
            print(
                f"| {b} | {cells} | {row[3] / row[1]:.2f}x | {row[1] * 1000 / b:.3f} | {timed[1][1] * 1000:.0f} |",
                flush=True,
            )
            del cache
            mx.clear_cache()
        print()


MEMORY_ONE = r"""
import json, os, subprocess, sys
import mlx.core as mx
import psutil
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import CACHE_LIMIT_UNBOUNDED, RunnerSettings
from runner.engine import Engine, GenerationRequest
release, tokens = sys.argv[1] == "on", int(sys.argv[2])
engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT,
                     RunnerSettings(cache_limit=CACHE_LIMIT_UNBOUNDED, release_enabled=release, prompt_cache=0))
mx.clear_cache(); mx.reset_peak_memory()
pool = 0
for last in engine.generate(GenerationRequest(prompt="Assignment statements are used to", max_tokens=tokens,
                                              num_draft_tokens=3, ignore_eos=True)):
    pool = max(pool, mx.get_cache_memory())
gpu = None
try:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20).stdout
    for line in out.splitlines():
        pid, used = [part.strip() for part in line.split(",")]
        if int(pid) == os.getpid():
            gpu = int(used) * 2**20
except Exception:
    pass
print(json.dumps({"generated": last.stats.generated_tokens, "releases": engine.total_releases,
                  "active": mx.get_active_memory(), "pool_end": mx.get_cache_memory(), "pool_max": pool,
                  "peak": mx.get_peak_memory(), "rss": psutil.Process().memory_info().rss, "gpu": gpu}))
"""


def fresh_process(script: str, *args: str, env: dict | None = None) -> dict | str:
    """Run ``script`` in a fresh Python process: the JSON object its last line prints, or (it failed) its
    last line of errors."""
    from tests.processes import child_environment

    done = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=child_environment() | (env or {})
    )
    if done.returncode:
        return str(done.stderr.strip().splitlines()[-1:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory() -> None:
    tokens = 600 if QUICK or FOCUS else 3000
    print(f"## memory: one speculative generation of {tokens} tokens (default pair, k = 3), pool cap lifted\n")
    print(
        "| release rule | releases | active | pool at most | pool at the end | peak | RSS | on the GPU (nvidia-smi) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for release in ("on", "off"):
        r = fresh_process(MEMORY_ONE, release, str(tokens))
        if isinstance(r, str):
            print(f"| {release} | failed: {r} |")
            continue
        mib = {k: f"{v / 2**20:.0f} MiB" if isinstance(v, int) else "-" for k, v in r.items()}
        print(
            f"| {release} | {r['releases']} | {mib['active']} | {mib['pool_max']} | {mib['pool_end']} "
            f"| {mib['peak']} | {mib['rss']} | {mib['gpu']} |"
        )
    print()


NEW_SHAPES_ONE = r"""
import json, sys, time
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import RunnerSettings
from runner.engine import Engine, GenerationRequest
tokens = int(sys.argv[1])
engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))
out = {}
for label, fields in (("plain", {"drafter": "none"}), ("draft model, k = 2", {"drafter": "model", "num_draft_tokens": 2}),
                      ("draft model, k = 4", {"drafter": "model", "num_draft_tokens": 4}),
                      ("n-gram, k = 3", {"drafter": "ngram", "num_draft_tokens": 3})):
    for turn in (1, 2):
        gaps, last = [], None
        for chunk in engine.generate(GenerationRequest(prompt="Repeat: for, while, break, continue; for, while,",
                                                       max_tokens=tokens, ignore_eos=True, cache_prompt=False, **fields)):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
        gaps.sort()
        out[f"{label}|{turn}"] = gaps[len(gaps) // 2] * 1000
print(json.dumps(out))
"""


def new_shapes() -> None:
    tokens = 24 if QUICK else 96
    print(f"## new shapes: one prompt decoded twice ({tokens} tokens), median ms per round, default pair\n")
    results = {}
    for rule in ("1", "0"):
        r = fresh_process(NEW_SHAPES_ONE, str(tokens), env={"MLXSERVE_PLAIN_ATTENTION": rule})
        if isinstance(r, str):
            print(f"rule {rule}: failed: {r}\n")
            continue
        results[rule] = r
    print("| decoder | rule on: first pass | second pass | rule off: first pass | second pass |")
    print("| --- | --- | --- | --- | --- |")
    labels = dict.fromkeys(key.split("|")[0] for r in results.values() for key in r)
    for label in labels:
        cells = [f"{results[r][f'{label}|{turn}']:.2f}" if r in results else "-" for r in ("1", "0") for turn in (1, 2)]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()


def speculation(tables: tuple = ("pair", "smol")) -> None:
    from bench import speculation as bench

    if QUICK:
        bench.run(pair_tokens=24, smol_tokens=16, depths=(1, 2), ngram_depths=(2,), tables=tables)
    elif FOCUS:
        bench.run(96, 96, (1, 2, 4), ngram_depths=(2, 4), reference_depths=(2, 4), prompts_per_kind=1, tables=tables)
    else:
        bench.run(
            pair_tokens=256,
            smol_tokens=160,
            depths=(1, 2, 3, 4, 6, 8, 10),
            ngram_depths=(1, 2, 4, 6, 8),
            reference_depths=(1, 2, 3, 4, 6, 8),
            prompts_per_kind=2,
            tables=tables,
        )


def batching() -> None:
    from bench import batching as bench
    from common.defaults import SMOLLM2_DIR
    from tests.processes import model_toml

    if QUICK:
        on, off, requests, tokens = (1, 4), (1, 4), 1, 8
    elif FOCUS:
        on, off, requests, tokens = (1, 16, 64), (1, 16), 1, 32
    else:
        on, off, requests, tokens = (1, 4, 16, 32, 64), (1, 16, 64), 1, 128
    bench.measure(
        "default pair (a lone request speculates with its draft)",
        model_toml("pair", max_queue=256),
        "pair",
        requests,
        tokens,
        False,
        on,
        off,
    )
    if FOCUS:
        return
    bench.measure(
        "SmolLM2-135M-Instruct, dtype auto (alone: n-gram drafting)",
        model_toml("smol", target=SMOLLM2_DIR, draft=None, max_queue=256),
        "smol",
        1,
        tokens // 2 if QUICK else 64,
        True,
        on,
        off,
    )


def prefill() -> None:
    """The default pair's prompt tok/s with chunks of at most 256 / 512 / 2048 tokens against mlx-lm's (one pass
    up to 2048): prefill_chunk "auto" takes 256 on the CPU, where attention computes a chunk's masked scores too,
    and 2048 on a GPU, whose fused attention does not. This decides the GPU's."""
    from bench.versus import prefill as versus_prefill
    from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from common.settings import RunnerSettings
    from runner.engine import Engine

    lengths = (200, 600) if QUICK else (1500, 8000)
    print("## prefill: chunk size against mlx-lm's generate_step, default pair\n")
    print("| prompt | measure | ours / mlx-lm | goal |\n| --- | --- | --- | --- |")
    for chunk in (256, 2048) if QUICK else (256, 512, 2048):
        engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0, prefill_chunk=chunk))
        for row in versus_prefill(f"chunks of at most {chunk}", engine, lengths):
            print(row, flush=True)
    print()


def prompt_cache() -> None:
    from bench import prompt_cache as bench
    from bench.figures import FIGURES

    bench.run(quick=QUICK, malloc_table=False, figure=FIGURES / "prompt_cache_gpu.png")


PARTS = {
    "env": env,
    "forward": forward,
    "memory": memory,
    "new_shapes": new_shapes,
    "speculation": speculation,
    "speculation_pair": lambda: speculation(("pair",)),
    "speculation_smol": lambda: speculation(("smol",)),
    "batching": batching,
    "prompt_cache": prompt_cache,
    "prefill": prefill,
}


def main() -> None:
    wanted = [a for a in sys.argv[1:] if not a.startswith("--")]
    unknown = [w for w in wanted if w not in PARTS]
    if not wanted or unknown:
        sys.exit(f"python -m bench.device PART [--quick]: PART is one of {', '.join(PARTS)}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for part in wanted:
        started = time.perf_counter()
        PARTS[part]()
        print(f"<!-- {part}: {time.perf_counter() - started:.0f} s -->\n", flush=True)


if __name__ == "__main__":
    main()
