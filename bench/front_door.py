"""The front door's cost: 16 clients straight to the runner vs through the supervisor (gRPC, OpenAI HTTP).

One supervisor serves the default pair with room for 16 rows. Each of 16
concurrent clients streams ``REQUESTS`` greedy requests of ``TOKENS`` tokens
(different prompts), either straight to the runner's unix socket (the runner's
own gRPC API, which the supervisor relays), through the supervisor's gRPC API, or
through its OpenAI HTTP API (streamed completions, read with httpx). The three
paths alternate, ``ROUNDS`` times, in one run; aggregate tok/s is every token
over the wall time of one load. The supervisor's CPU (user + system, its own
process only) is read around each load: per relayed chunk, after taking off
what it spends over the same time while the clients talk to the runner
directly (its memory watch and health checks).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
from pathlib import Path

import psutil

from .batching import concurrently

CLIENTS = 16
REQUESTS = 2
TOKENS = 128
ROUNDS = 3
PROMPT = "The for statement is used to iterate over the elements of a sequence"


def load(send, clients: int = CLIENTS, requests: int = REQUESTS, tokens: int = TOKENS) -> dict:
    """``send(prompt, tokens)`` streams one request and returns (generated tokens, chunks)."""
    totals = {"tokens": 0, "chunks": 0, "failed": []}
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            try:
                generated, chunks = send(f"{PROMPT} {c * requests + r}", tokens)
            except Exception as error:  # counted and shown, not raised: one failure spoils a figure, not the run
                with lock:
                    totals["failed"].append(type(error).__name__)
                continue
            with lock:
                totals["tokens"] += generated
                totals["chunks"] += chunks

    totals["wall"] = concurrently(clients, client)
    return totals


def senders(sup) -> dict:
    import httpx

    from common.client import RunnerClient
    from common.protocol import runner_pb2
    from supervisor.protocol import supervisor_pb2

    runner = RunnerClient(f"unix://{sup.runtime_dir}/pair.sock")
    http = httpx.Client(base_url=sup.base_url, timeout=600, limits=httpx.Limits(max_connections=64))

    def direct(prompt: str, tokens: int):
        request = runner_pb2.GenerateRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True)
        chunks = list(runner.stub.Generate(request, timeout=600))
        return chunks[-1].stats.generated_tokens, len(chunks)

    def grpc_api(prompt: str, tokens: int):
        request = supervisor_pb2.GenerateRequest(model="pair", prompt=prompt, max_tokens=tokens, ignore_eos=True)
        chunks = list(sup.client.stub.Generate(request, timeout=600))
        return chunks[-1].stats.generated_tokens, len(chunks)

    def http_api(prompt: str, tokens: int):
        body = {
            "model": "pair",
            "prompt": prompt,
            "max_tokens": tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        generated = events = 0
        with http.stream("POST", "/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events += 1
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        generated = usage["completion_tokens"]
        return generated, events

    return {
        "runner direct (its gRPC API)": direct,
        "through the supervisor, gRPC": grpc_api,
        "through the supervisor, OpenAI HTTP (SSE)": http_api,
    }


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure() -> tuple[dict, dict]:
    from tests.processes import SupervisorProcess, model_toml

    with tempfile.TemporaryDirectory() as folder:
        sup = SupervisorProcess(Path(folder), model_toml("pair", max_batch=CLIENTS)).wait_ready(300)
        try:
            paths = senders(sup)
            process = psutil.Process(sup.process.pid)
            for send in paths.values():  # warm-up: every batch size's kernels, every connection
                load(send, requests=1, tokens=8)
            runs: dict = {label: [] for label in paths}
            for _ in range(ROUNDS):
                for label, send in paths.items():
                    before = cpu_seconds(process)
                    result = load(send)
                    result["cpu"] = cpu_seconds(process) - before
                    runs[label].append(result)
            rss = process.memory_info().rss
        finally:
            sup.stop()
    return runs, {"rss": rss}


def run() -> None:
    runs, extra = measure()
    direct_label = next(iter(runs))
    direct = runs[direct_label]
    idle_cpu = statistics.median(r["cpu"] / r["wall"] for r in direct)  # supervisor CPU per second, not relaying
    print(
        f"### front door: {CLIENTS} clients x {REQUESTS} requests x {TOKENS} greedy tokens, default pair, "
        f"max_batch {CLIENTS}; {ROUNDS} rounds, paths alternated\n"
    )
    print(
        "| path | aggregate tok/s (median) | vs runner direct, per round | chunks per load "
        "| supervisor CPU per relayed chunk | failed |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, results in runs.items():
        rates = [r["tokens"] / r["wall"] for r in results]
        ratios = [rate / (d["tokens"] / d["wall"]) for rate, d in zip(rates, direct)]
        if label == direct_label:
            cpu = f"({idle_cpu * 100:.1f}% of a core while not relaying)"
        else:
            per_chunk = [(r["cpu"] - idle_cpu * r["wall"]) / max(1, r["chunks"]) for r in results]
            cpu = f"{statistics.median(per_chunk) * 1e6:.0f} us"
        failed = sum(len(r["failed"]) for r in results)
        print(
            f"| {label} | {statistics.median(rates):.0f} | {', '.join(f'{x:.2f}x' for x in ratios)} "
            f"| {statistics.median(r['chunks'] for r in results):.0f} | {cpu} | {failed} |"
        )
    print(f"\nSupervisor RSS after the loads: {extra['rss'] / 2**20:.0f} MiB.\n")
