"""Runner groups (``ranks``): one process against two, tensor and pipeline parallel, over MLX's ring backend
on loopback.

For the default pair, one runner process with ``--ranks 1``, one with ``--ranks
2`` (tensor parallel) and one with ``--ranks 2 --parallelism pipeline``,
alternated: greedy decoding tok/s plain and speculative (draft model), aggregate
tok/s of 8 concurrent clients, and each rank's memory (RSS with psutil; MLX's
active bytes once loaded, from Info). The same for SmolLM2 (if ``make
real-model`` ran), which only a pipeline splits two ways (9 heads), plain and 8
clients. Then what a group costs a step: the collectives of a decode step's
activation (1 x hidden) between two processes, timed alone (an ``all_sum`` for
tensor parallelism, two per layer; one send/recv hop and one ``all_gather`` for
a pipeline), against the group's time per plain token.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from common.defaults import DEFAULT_TARGET
from common.protocol import runner_pb2

PROMPT = "The for statement is used to iterate over"
TOKENS = 300
ROUNDS = 3

COLLECTIVE = r"""
import json, sys, time
import mlx.core as mx
from runner.group import join
from pathlib import Path
group = join(int(sys.argv[1]), Path(sys.argv[2]))
x = mx.ones((1, 1, int(sys.argv[3])))
for _ in range(20):
    mx.eval(mx.distributed.all_sum(x, group=group.group, stream=mx.cpu))
start = time.perf_counter()
for _ in range(500):
    mx.eval(mx.distributed.all_sum(x, group=group.group, stream=mx.cpu))
seconds = (time.perf_counter() - start) / 500
start = time.perf_counter()
for _ in range(500):
    group.share_int(3)
share = (time.perf_counter() - start) / 500
start = time.perf_counter()
for _ in range(500):  # a pipeline's hop: rank 1 sends its hidden state to rank 0
    if group.rank == 1:
        mx.eval(mx.distributed.send(x, 0, group=group.group))
    else:
        mx.eval(mx.distributed.recv_like(x, 1, group=group.group))
hop = (time.perf_counter() - start) / 500
start = time.perf_counter()
for _ in range(500):
    mx.eval(mx.distributed.all_gather(x, group=group.group))
gather = (time.perf_counter() - start) / 500
print(json.dumps({"all_sum": seconds, "share": share, "hop": hop, "all_gather": gather}))
"""

# (label, extra runner flags); the first is the baseline.
SETUPS = {
    "1": ("--ranks", "1"),
    "2, tensor": ("--ranks", "2", "--parallelism", "tensor"),
    "2, pipeline": ("--ranks", "2", "--parallelism", "pipeline"),
}


def generate(runner, **fields):
    last = None
    for last in runner.client.generate(timeout=600, prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, **fields):
        pass
    return last.stats.tokens_per_second


def concurrent(runner, clients: int = 8, tokens: int = 64) -> float:
    def one(i):
        last = None
        for last in runner.client.generate(
            timeout=600, prompt=PROMPT + " " * i, max_tokens=tokens, ignore_eos=True, drafter="none"
        ):
            pass
        return last.stats.generated_tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(one, range(clients)))
    return done / (time.perf_counter() - start)


def collective_seconds(hidden: int) -> dict:
    from runner.group import free_ports
    from tests.processes import child_environment

    with tempfile.TemporaryDirectory() as folder:
        hostfile = Path(folder) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", COLLECTIVE, str(rank), str(hostfile), str(hidden)],
                stdout=subprocess.PIPE,
                text=True,
                env=child_environment(),
            )
            for rank in range(2)
        ]
        out = [r.communicate(timeout=300)[0] for r in ranks]
    return json.loads(out[0].strip().splitlines()[-1])


def measure(setups: dict, target=DEFAULT_TARGET, draft=None, speculative: bool = True) -> tuple[dict, dict]:
    """Median tok/s per setup (alternated rounds) and each setup's (RSS per rank, MLX active per rank)."""
    from common.defaults import DEFAULT_DRAFT
    from tests.processes import RunnerProcess

    draft = DEFAULT_DRAFT if speculative else None
    memory = {}
    with tempfile.TemporaryDirectory() as folder:
        runners = {}
        for i, (label, flags) in enumerate(setups.items()):
            runners[label] = RunnerProcess(
                Path(folder) / f"r{i}", *flags, "--prompt-cache", "0", target=target, draft=draft, name=f"r{i}"
            ).wait_serving(300)
        try:
            for label, runner in runners.items():
                info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
                pids = [runner.process.pid, *info.rank_pids]
                memory[label] = (
                    [psutil.Process(p).memory_info().rss for p in pids],
                    list(info.rank_memory) or [runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).active],
                )
            kinds = ("plain", "speculative", "8 clients") if speculative else ("plain", "8 clients")
            samples = {label: {k: [] for k in kinds} for label in runners}
            for _ in range(ROUNDS):  # alternated, so the machine's drift falls on all alike
                for label, runner in runners.items():
                    samples[label]["plain"].append(generate(runner, drafter="none"))
                    if speculative:
                        samples[label]["speculative"].append(generate(runner, drafter="model"))
                    samples[label]["8 clients"].append(concurrent(runner))
        finally:
            for runner in runners.values():
                runner.stop()
    rows = {label: {k: statistics.median(v) for k, v in s.items()} for label, s in samples.items()}
    return rows, memory


def table(rows: dict, memory: dict) -> None:
    kinds = list(next(iter(rows.values())))
    print(f"| ranks | {' | '.join(k + ' tok/s' for k in kinds)} | RSS per rank | MLX active per rank |")
    print("| --- " * (len(kinds) + 3) + "|")
    base = next(iter(rows.values()))
    for label, r in rows.items():
        rss, active = memory[label]
        cells = " | ".join(f"{r[k]:.1f} ({r[k] / base[k]:.2f}x)" for k in kinds)
        print(
            f"| {label} | {cells} | {' / '.join(f'{b / 2**20:.0f} MiB' for b in rss)} "
            f"| {' / '.join(f'{b / 2**20:.1f} MiB' for b in active)} |"
        )


def run() -> None:
    from common.defaults import SMOLLM2_DIR

    config = json.loads((DEFAULT_TARGET / "config.json").read_text())
    rows, memory = measure(SETUPS)
    costs = collective_seconds(config["hidden_size"])
    print(f"## runner groups: the default pair, {TOKENS} greedy tokens, 1 process against 2\n")
    table(rows, memory)
    tensor_forward = 2 * config["num_hidden_layers"] * costs["all_sum"]
    pipeline_forward = costs["hop"] + costs["all_gather"]
    for label, forward, what in (
        ("2, tensor", tensor_forward, f"{2 * config['num_hidden_layers']} all_sums"),
        ("2, pipeline", pipeline_forward, "one send/recv hop and one all_gather"),
    ):
        step = 1 / rows[label]["plain"]
        print(
            f"\n{label}: a forward pass makes {what} of 1 x {config['hidden_size']} float32 "
            f"({forward * 1000:.2f} ms alone), against {step * 1000:.2f} ms per plain token: {forward / step:.0%}."
        )
    print(
        f"\nAlone, between two processes: all_sum {costs['all_sum'] * 1e6:.0f} us, send/recv "
        f"{costs['hop'] * 1e6:.0f} us, all_gather {costs['all_gather'] * 1e6:.0f} us; sharing one of rank 0's "
        f"decisions (a depth, a turn's admissions) {costs['share'] * 1e6:.0f} us.\n"
    )
    if SMOLLM2_DIR.is_dir():
        smol = {label: flags for label, flags in SETUPS.items() if label != "2, tensor"}
        rows, memory = measure(smol, target=SMOLLM2_DIR, speculative=False)
        print(f"## SmolLM2-135M (9 heads: only a pipeline splits it), {TOKENS} greedy tokens\n")
        table(rows, memory)
        print()
