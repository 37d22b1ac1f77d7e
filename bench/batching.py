"""Many clients at once: aggregate tok/s and time to first token, batching on and off, through the supervisor.

Each of N concurrent clients streams ``REQUESTS`` greedy requests one after the
other over the supervisor's gRPC API (each a different prompt, so the prompt
cache does not hide the prefill). Aggregate tok/s is every generated token over
the wall time of the whole load; time to first token is per request, measured
by the client. "off" runs the same load with ``max_batch = 1`` (one request at
a time, each speculating alone, the others waiting in the queue).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from common.defaults import SMOLLM2_DIR

CLIENTS = (1, 2, 4, 8, 16, 32)
PROMPT = "The for statement is used to iterate over the elements of a sequence"
QUESTION = "Tell me about the history of the city number {i} on your list of European capitals."


def concurrently(clients: int, client) -> float:
    """``client(c)`` for c in range(clients), each on its own thread, all at once: the wall time until the last
    has finished."""
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started


def load(sup, model: str, clients: int, requests: int, tokens: int, chat: bool) -> dict:
    from supervisor.protocol import supervisor_pb2

    ttfts, generated, refused, failed = [], [0], [0], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(requests):
            request = supervisor_pb2.GenerateRequest(model=model, max_tokens=tokens, ignore_eos=True)
            if chat:
                request.messages.add(role="user", content=QUESTION.format(i=c * requests + r))
            else:
                request.prompt = f"{PROMPT} {c * requests + r}"
            started = time.perf_counter()
            first = None
            try:
                for chunk in sup.client.stub.Generate(request, timeout=1800):
                    if first is None and chunk.token_ids:
                        first = time.perf_counter() - started
                with lock:
                    ttfts.append(first)
                    generated[0] += chunk.stats.generated_tokens
            except grpc.RpcError as error:
                with lock:
                    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        refused[0] += 1
                    else:
                        failed.append(error.code().name)

    wall = concurrently(clients, client)
    ttfts.sort()
    return {
        "rate": generated[0] / wall,
        "p50": statistics.median(ttfts) if ttfts else float("nan"),
        "p95": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan"),
        "refused": refused[0],
        "failed": failed,
    }


def measure(
    label: str,
    toml_model: str,
    model: str,
    requests: int,
    tokens: int,
    chat: bool,
    clients_on: tuple = CLIENTS,
    clients_off: tuple = CLIENTS,
    figure: str | None = None,
) -> None:
    """``clients_off``: the loads also run one at a time (a large one-at-a-time load takes long and its
    aggregate rate hardly moves with the number of clients: bench/device.py runs a few)."""
    from tests.processes import SupervisorProcess

    rows = {}
    for mode, max_batch, counts in (("off", 1, clients_off), ("on", max(clients_on), clients_on)):
        with tempfile.TemporaryDirectory() as folder:
            sup = SupervisorProcess(Path(folder), toml_model + f"max_batch = {max_batch}\n").wait_ready(300)
            try:
                # Warm-up at each load's size: a batch of a new size compiles kernels on a GPU (docs/gpu.md).
                for clients in counts:
                    load(sup, model, clients, 1, 8, chat)
                for clients in counts:
                    rows[(mode, clients)] = load(sup, model, clients, requests, tokens, chat)
            finally:
                sup.stop()
    print(f"## batching: {label}, each client {requests} x {tokens} greedy tokens\n")
    print(
        "| clients | batching | aggregate tok/s | vs one at a time | vs 1 client | time to first token p50 / p95 "
        "| refused |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for clients in sorted(set(clients_on) | set(clients_off)):
        for mode in ("off", "on"):
            r = rows.get((mode, clients))
            if r is None:
                continue
            off = rows.get(("off", clients))
            versus = f"{r['rate'] / off['rate']:.2f}x" if off else "-"
            print(
                f"| {clients} | {mode} | {r['rate']:.0f} | {versus} "
                f"| {r['rate'] / rows[(mode, 1)]['rate']:.2f}x | {r['p50']:.2f} s / {r['p95']:.2f} s "
                f"| {r['refused']}{' failed ' + str(r['failed']) if r['failed'] else ''} |"
            )
    print()
    if figure:
        from .figures import FIGURES, line_figure

        def series(key: str, scale: float = 1.0) -> list:
            return [
                (
                    f"batching {mode}",
                    [c for c in sorted(counts) if (mode, c) in rows],
                    [rows[(mode, c)][key] * scale for c in sorted(counts) if (mode, c) in rows],
                )
                for mode, counts in (("on", clients_on), ("off", clients_off))
            ]

        path = line_figure(
            FIGURES / figure,
            f"Batching: {label}",
            [
                {"title": "aggregate throughput", "x": "concurrent clients", "y": "tok/s", "series": series("rate")},
                {
                    "title": "time to first token, p95",
                    "x": "concurrent clients",
                    "y": "seconds",
                    "series": series("p95"),
                    "log_y": True,
                },
            ],
        )
        print(
            f"![Aggregate tok/s and p95 time to first token against clients, batching on and off](figures/{path.name})\n"
        )


def run() -> None:
    from tests.processes import model_toml

    measure(
        "default pair (a lone request speculates with its draft)",
        model_toml("pair"),
        "pair",
        2,
        128,
        False,
        figure="batching_pair.png",
    )
    measure(
        "SmolLM2-135M-Instruct, float32 (alone: n-gram drafting)",
        model_toml("smol", target=SMOLLM2_DIR, draft=None),
        "smol",
        1,
        48,
        True,
        figure="batching_smol.png",
    )
