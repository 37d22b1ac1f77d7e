"""Runner groups (``ranks``): one process against two (tensor parallel over MLX's ring backend on loopback).

For the default pair, one runner process with ``--ranks 1`` and one with
``--ranks 2``, alternated: greedy decoding tok/s plain and speculative (draft
model), aggregate tok/s of 8 concurrent clients, and each rank's memory (RSS
with psutil; MLX's active bytes once loaded, from Info). Then what the group
costs a step: one ``all_sum`` of a decode step's activation (1 x hidden) between
two processes, timed alone, times the collectives a forward pass makes (two per
layer), against the group's time per plain token.
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
print(json.dumps({"all_sum": seconds, "share": (time.perf_counter() - start) / 500}))
"""


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


def run() -> None:
    from tests.processes import RunnerProcess

    config = json.loads((DEFAULT_TARGET / "config.json").read_text())
    rows, memory = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        runners = {
            ranks: RunnerProcess(Path(folder) / f"r{ranks}", "--ranks", str(ranks), "--prompt-cache", "0").wait_serving(
                180
            )
            for ranks in (1, 2)
        }
        try:
            for ranks, runner in runners.items():
                info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
                pids = [runner.process.pid, *info.rank_pids]
                memory[ranks] = (
                    [psutil.Process(p).memory_info().rss for p in pids],
                    list(info.rank_memory) or [runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).active],
                )
            samples = {ranks: {"plain": [], "speculative": [], "8 clients": []} for ranks in runners}
            for _ in range(ROUNDS):  # alternated, so the machine's drift falls on both alike
                for ranks, runner in runners.items():
                    samples[ranks]["plain"].append(generate(runner, drafter="none"))
                    samples[ranks]["speculative"].append(generate(runner, drafter="model"))
                    samples[ranks]["8 clients"].append(concurrent(runner))
            rows = {ranks: {k: statistics.median(v) for k, v in s.items()} for ranks, s in samples.items()}
        finally:
            for runner in runners.values():
                runner.stop()
    costs = collective_seconds(config["hidden_size"])
    per_forward = 2 * config["num_hidden_layers"] * costs["all_sum"]
    print(f"## runner groups: the default pair, {TOKENS} greedy tokens, 1 process against 2 (tensor parallel)\n")
    print(
        "| ranks | plain tok/s | speculative tok/s | 8 clients, aggregate tok/s | RSS per rank | MLX active per rank |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for ranks, r in rows.items():
        rss, active = memory[ranks]
        base = rows[1]
        print(
            f"| {ranks} | {r['plain']:.1f} ({r['plain'] / base['plain']:.2f}x) "
            f"| {r['speculative']:.1f} ({r['speculative'] / base['speculative']:.2f}x) "
            f"| {r['8 clients']:.1f} ({r['8 clients'] / base['8 clients']:.2f}x) "
            f"| {' / '.join(f'{b / 2**20:.0f} MiB' for b in rss)} | {' / '.join(f'{b / 2**20:.1f} MiB' for b in active)} |"
        )
    step = 1 / rows[2]["plain"]
    print(
        f"\nThe collectives' share of a step: one all_sum of 1 x {config['hidden_size']} float32 between two "
        f"processes takes {costs['all_sum'] * 1e6:.0f} us here, a forward pass makes "
        f"{2 * config['num_hidden_layers']} of them ({per_forward * 1000:.2f} ms), against {step * 1000:.2f} ms per "
        f"plain token in the group: {per_forward / step:.0%}. Sharing one of rank 0's decisions (a depth, a "
        f"turn's admissions) takes {costs['share'] * 1e6:.0f} us.\n"
    )
