"""Through the supervisor (gRPC and the OpenAI HTTP API) vs straight to the runner vs in-process;
the supervisor's CPU while watching N runners, its RSS and the CLI's start-up time."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from common.client import RunnerClient
from common.cpu_blas import fast_blas_environment
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from runner.engine import Engine
from supervisor.client import SupervisorClient

from .runner import PROMPTS, TOKENS, in_process, over_grpc


def through_supervisor(client: SupervisorClient, model: str) -> tuple[float, float]:
    tokens, seconds, ttft = 0, 0.0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        first = None
        for chunk in client.generate(timeout=300, model=model, prompt=prompt, max_tokens=TOKENS, ignore_eos=True):
            first = first or time.perf_counter()
        seconds += time.perf_counter() - first
        ttft += first - start
        tokens += chunk.stats.generated_tokens
    return tokens / seconds, ttft / len(PROMPTS)


def through_http(base_url: str, model: str) -> tuple[float, float]:
    """The official OpenAI client, streaming completions; tok/s from the usage the stream ends with."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    tokens, seconds, ttft = 0, 0.0, 0.0
    for prompt in PROMPTS:
        start = time.perf_counter()
        first = None
        for event in client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            if event.choices and event.choices[0].text:
                first = first or time.perf_counter()
            if event.usage is not None:
                tokens += event.usage.completion_tokens
        seconds += time.perf_counter() - first
        ttft += first - start
    return tokens / seconds, ttft / len(PROMPTS)


def serve(config: Path, text: str) -> subprocess.Popen:
    """``python -m supervisor serve`` on the config ``text``, written to ``config`` (its stderr dropped)."""
    config.write_text(text)
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(config)],
        stderr=subprocess.DEVNULL,
        env=fast_blas_environment(),
    )


def start_supervisor(folder: Path, n_models: int, port: int, http_port: int = 0) -> subprocess.Popen:
    models = "".join(
        f'[models.m{i}]\ntarget = "{DEFAULT_TARGET}"\ndraft = "{DEFAULT_DRAFT}"\n' for i in range(n_models)
    )
    http = f"127.0.0.1:{http_port}" if http_port else ""
    return serve(
        folder / f"bench-{n_models}.toml",
        f'listen = "127.0.0.1:{port}"\nhttp_listen = "{http}"\nprobe_port = 0\n'
        f'runtime_dir = "{folder}/run{n_models}"\n{models}',
    )


def cli_start_up(port: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "supervisor", "models", "--address", f"127.0.0.1:{port}"],
            check=True,
            capture_output=True,
            env=fast_blas_environment(),
        )
        best = min(best, time.perf_counter() - start)
    return best


def idle_cpu_share(process: subprocess.Popen, seconds: float = 5.0) -> float:
    p = psutil.Process(process.pid)
    p.cpu_percent(None)
    time.sleep(seconds)
    return p.cpu_percent(None)


def run() -> None:
    from tests.processes import free_port

    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    engine.warm_up()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        port, http_port = free_port(), free_port()
        sup = start_supervisor(folder, 1, port, http_port)
        client = SupervisorClient(f"127.0.0.1:{port}")
        try:
            assert client.wait_serving(120)
            runner = RunnerClient(f"unix://{folder}/run1/m0.sock")
            through_supervisor(client, "m0")  # warm-up
            base_url = f"http://127.0.0.1:{http_port}/v1"
            through_http(base_url, "m0")
            rows = [
                ("engine in-process", *in_process(engine)),
                ("runner over gRPC", *over_grpc(runner)),
                ("through the supervisor, gRPC", *through_supervisor(client, "m0")),
                ("through the supervisor, OpenAI HTTP API (openai client, SSE)", *through_http(base_url, "m0")),
            ]
            supervisor_rss = psutil.Process(sup.pid).memory_info().rss
            cli = cli_start_up(port)
        finally:
            sup.terminate()
            sup.wait()
        cpu = []
        for n in (1, 2, 4):
            port = free_port()
            sup = start_supervisor(folder, n, port)
            try:
                assert SupervisorClient(f"127.0.0.1:{port}").wait_serving(180)
                cpu.append((n, idle_cpu_share(sup)))
            finally:
                sup.terminate()
                sup.wait()
    base_rate, base_ttft = rows[0][1], rows[0][2]
    print(f"## supervisor: {len(PROMPTS)} prompts x {TOKENS} tokens, default k\n")
    print("| path | tok/s | vs in-process | time to first token | vs in-process |")
    print("| --- | --- | --- | --- | --- |")
    for name, rate, ttft in rows:
        print(f"| {name} | {rate:.0f} | {rate / base_rate:.2f}x | {ttft * 1000:.1f} ms | {ttft / base_ttft:.2f}x |")
    print(
        f"\nSupervisor RSS while serving one model: {supervisor_rss / 2**20:.0f} MiB; "
        f"`python -m supervisor models` start to exit: {cli:.2f} s (best of 3). Neither loads MLX."
    )
    print("\n| runners watched (1 s memory samples, 2 s health checks) | supervisor CPU while idle |")
    print("| --- | --- |")
    for n, share in cpu:
        print(f"| {n} | {share:.1f}% of one core |")
    print()
