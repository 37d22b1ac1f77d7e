"""max_loaded = 1 under load: how long a request for a second model waits while clients keep the first one busy.

A supervisor serves two copies of the default pair ("a" and "b") with ``max_loaded = 1``. ``CLIENTS`` clients ask
"a" for ``TOKENS`` greedy tokens, back to back, for the whole run; after ``LEAD`` seconds one request asks "b" for
4 tokens (the gRPC client, deadline ``DEADLINE`` s). The table says when "b" answered (or how it was refused), how
many of "a"'s requests were answered and failed, and the longest any of them took, which includes the swaps
(a's new requests wait while "a" makes room for "b", then load "a" again): supervisor.scheduler.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from supervisor.client import SupervisorClient

from .supervisor import serve

CLIENTS = 2
TOKENS = 64
LEAD = 3.0  # seconds of "a" alone before "b" is asked
DEADLINE = 60.0  # the request for "b"
AFTER = 10.0  # seconds the clients of "a" go on once "b" has answered or been refused


def start(folder: Path, port: int) -> subprocess.Popen:
    models = "".join(
        f'[models.{m}]\ntarget = "{DEFAULT_TARGET}"\ndraft = "{DEFAULT_DRAFT}"\nload_at_start = {str(m == "a").lower()}\n'
        for m in "ab"
    )
    return serve(
        folder / "scheduler.toml",
        f'listen = "127.0.0.1:{port}"\nhttp_listen = ""\nprobe_port = 0\nmax_loaded = 1\n'
        f'runtime_dir = "{folder}/run"\n{models}',
    )


def measure(client: SupervisorClient) -> dict:
    stop = threading.Event()
    durations: list[float] = []
    failures: list[str] = []

    def keep_busy() -> None:
        while not stop.is_set():
            began = time.monotonic()
            try:
                for _ in client.generate(timeout=300, model="a", prompt="x", max_tokens=TOKENS, ignore_eos=True):
                    pass
                durations.append(time.monotonic() - began)
            except grpc.RpcError as error:
                failures.append(f"{error.code().name}: {error.details()}")

    threads = [threading.Thread(target=keep_busy) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    time.sleep(LEAD)
    asked = time.monotonic()
    try:
        for chunk in client.generate(timeout=DEADLINE, model="b", prompt="x", max_tokens=4, ignore_eos=True):
            pass
        outcome = f"answered ({chunk.stats.generated_tokens} tokens)"
    except grpc.RpcError as error:
        outcome = f"{error.code().name}: {error.details()[:80]}"
    waited = time.monotonic() - asked
    time.sleep(AFTER)
    stop.set()
    for thread in threads:
        thread.join(300)
    return {"b": outcome, "waited": waited, "a": durations, "failed": failures}


def run() -> None:
    from tests.processes import free_port

    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        process = start(Path(tmp), port)
        client = SupervisorClient(f"127.0.0.1:{port}")
        try:
            assert client.wait_serving(120, service="a")
            for _ in client.generate(timeout=120, model="a", prompt="x", max_tokens=8):  # warm-up
                pass
            result = measure(client)
        finally:
            process.terminate()
            process.wait(60)
    a = sorted(result["a"])
    print(
        f"## scheduler: max_loaded = 1, {CLIENTS} clients asking model a for {TOKENS} tokens back to back, one "
        f"request for model b ({DEADLINE:.0f} s deadline) after {LEAD:.0f} s\n"
    )
    print("| request for b | its wait | a's requests answered | failed | a's median | a's longest |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {result['b']} | {result['waited']:.1f} s | {len(a)} | {len(result['failed'])} "
        f"| {a[len(a) // 2]:.2f} s | {a[-1]:.2f} s |\n"
    )
    for failure in sorted(set(result["failed"])):
        print(f"- a failed: {failure}")
