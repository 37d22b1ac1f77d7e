"""The runner's gRPC stream vs the engine in-process; runner start-up vs loading in-process."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.client import RunnerClient
from common.cpu_blas import fast_blas_environment
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from runner.engine import Engine, GenerationRequest

PROMPTS = (
    "The for statement is used to iterate over the elements of a sequence",
    "Assignment statements are used to (re-)bind names to values",
    "A class definition defines a class object",
)
TOKENS = 512


def in_process(engine: Engine) -> tuple[float, float]:
    tokens, seconds, ttft = 0, 0.0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        first = None
        for r in engine.generate(GenerationRequest(prompt=prompt, max_tokens=TOKENS, ignore_eos=True)):
            first = first or time.perf_counter()
        seconds += time.perf_counter() - first
        ttft += first - start
        tokens += r.stats.generated_tokens
    return tokens / seconds, ttft / len(PROMPTS)


def over_grpc(client: RunnerClient) -> tuple[float, float]:
    tokens, seconds, ttft = 0, 0.0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        first = None
        for chunk in client.generate(timeout=300, prompt=prompt, max_tokens=TOKENS, ignore_eos=True):
            first = first or time.perf_counter()
        seconds += time.perf_counter() - first
        ttft += first - start
        tokens += chunk.stats.generated_tokens
    return tokens / seconds, ttft / len(PROMPTS)


def start_runner(socket: Path) -> tuple[subprocess.Popen, RunnerClient, float]:
    start = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner",
            "--target",
            str(DEFAULT_TARGET),
            "--draft",
            str(DEFAULT_DRAFT),
            "--listen",
            f"unix://{socket}",
        ],
        stderr=subprocess.DEVNULL,
        env=fast_blas_environment(),
    )
    client = RunnerClient(f"unix://{socket}")
    assert client.wait_serving(120, alive=lambda: process.poll() is None)
    return process, client, time.perf_counter() - start


def run() -> None:
    start = time.perf_counter()
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    engine.warm_up()
    load_seconds = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        process, client, spawn_seconds = start_runner(Path(tmp) / "sockets" / "r.sock")
        try:
            over_grpc(client)  # warm-up
            local_rate, local_ttft = in_process(engine)
            grpc_rate, grpc_ttft = over_grpc(client)
        finally:
            process.terminate()
            process.wait()
    print(f"## runner: {len(PROMPTS)} prompts x {TOKENS} tokens, default k\n")
    print("| path | tok/s | time to first token | start-up |")
    print("| --- | --- | --- | --- |")
    print(
        f"| engine in-process | {local_rate:.0f} | {local_ttft * 1000:.1f} ms | {load_seconds:.2f} s (load + warm-up) |"
    )
    print(
        f"| runner over gRPC (unix socket) | {grpc_rate:.0f} | {grpc_ttft * 1000:.1f} ms | {spawn_seconds:.2f} s (spawn to SERVING) |"
    )
    print(
        f"| ratio gRPC / in-process | {grpc_rate / local_rate:.2f}x | {grpc_ttft / local_ttft:.2f}x | {spawn_seconds / load_seconds:.2f}x |\n"
    )
