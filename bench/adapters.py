"""LoRA adapters over one base (runner/loading/adapters.py): what an adapter costs a request alone, and what 8 clients
get when they all use the base, all one adapter, or a mix of two adapters and the base (rows of one batch).

The default pair's target with two random LoRA adapters in mlx-lm's format (rank 8 on q and v, rank 4 on q and
o, every layer), through one supervisor; greedy, 96 tokens a request, the runner's adaptive speculation on.
Each configuration is run three times, alternated; the medians are shown.
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

from .batching import concurrently

PROMPT = "The for statement is used to iterate over the elements of a sequence"
TOKENS = 96
CLIENTS = 8
ROUNDS = 3


def run() -> None:
    from supervisor.protocol import supervisor_pb2
    from tests.processes import SupervisorProcess, model_toml
    from tests.test_adapters import write_adapter

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        terse = write_adapter(root / "terse", ("self_attn.q_proj", "self_attn.v_proj"), rank=8, seed=1)
        loud = write_adapter(root / "loud", ("self_attn.q_proj", "self_attn.o_proj"), rank=4, seed=2)
        models = (
            model_toml("plain", max_batch=CLIENTS)
            + model_toml("pair", max_batch=CLIENTS)
            + f'adapters = {{terse = "{terse}", loud = "{loud}"}}\n'
        )
        sup = SupervisorProcess(root / "sup", models).wait_ready(180)
        try:

            def one(model: str) -> float:
                model, _, plain = model.partition(" ")
                started, tokens = time.perf_counter(), 0
                for chunk in sup.client.generate(
                    timeout=300,
                    model=model,
                    prompt=PROMPT,
                    max_tokens=TOKENS,
                    ignore_eos=True,
                    drafter="none" if plain else "",
                ):
                    tokens += len(chunk.token_ids)
                return tokens / (time.perf_counter() - started)

            def many(models: list[str]) -> float:
                counted = [0]
                lock = threading.Lock()

                def client(c: int) -> None:
                    request = supervisor_pb2.GenerateRequest(
                        model=models[c % len(models)], prompt=f"{PROMPT} {c}", max_tokens=TOKENS, ignore_eos=True
                    )
                    got = sum(len(chunk.token_ids) for chunk in sup.client.stub.Generate(request, timeout=600))
                    with lock:
                        counted[0] += got

                seconds = concurrently(CLIENTS, client)
                return counted[0] / seconds

            singles = {
                name: [] for name in ("plain", "pair", "pair:terse", "pair:loud", "plain plain", "pair:terse plain")
            }
            batches = {"all base": [], "all pair:terse": [], "mixed: base, terse, loud": []}
            mixes = {
                "all base": ["pair"],
                "all pair:terse": ["pair:terse"],
                "mixed: base, terse, loud": ["pair", "pair:terse", "pair:loud"],
            }
            for model in singles:
                one(model)  # warm each (load, compile)
            for _ in range(ROUNDS):
                for model in singles:
                    singles[model].append(one(model))
                for name, chosen in mixes.items():
                    batches[name].append(many(chosen))
        finally:
            sup.stop()

    base = statistics.median(singles["plain"])
    print(f"### one request alone, {TOKENS} greedy tokens (median of {ROUNDS})\n")
    print("| model | tok/s | vs the runner without adapters (plain rows: vs its plain decoding) |")
    print("| --- | ---: | ---: |")
    labels = {
        "plain": "the target, runner without adapters",
        "pair": "the base, on the runner with adapters",
        "pair:terse": "adapter terse (rank 8, q and v)",
        "pair:loud": "adapter loud (rank 4, q and o)",
        "plain plain": "the target, runner without adapters, plain decoding (no drafts)",
        "pair:terse plain": "adapter terse, plain decoding (no drafts)",
    }
    plain = statistics.median(singles["plain plain"])
    for model, values in singles.items():
        value = statistics.median(values)
        against = plain if model.endswith(" plain") else base
        print(f"| {labels[model]} | {value:.0f} | {value / against:.2f}x |")
    print(
        "\nThe draft model has no adapters: it drafts for the base, so an adapter that moves the model far (random "
        "weights here) lowers the acceptance of speculation; plain decoding shows what the adapter's own "
        "matrices cost."
    )
    print(f"\n### {CLIENTS} clients at once, {TOKENS} greedy tokens each (aggregate, median of {ROUNDS})\n")
    print("| requests | aggregate tok/s | vs all base |")
    print("| --- | ---: | ---: |")
    all_base = statistics.median(batches["all base"])
    for name, values in batches.items():
        value = statistics.median(values)
        print(f"| {name} | {value:.0f} | {value / all_base:.2f}x |")
