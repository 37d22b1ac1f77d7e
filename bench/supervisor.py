"""Through the supervisor vs straight to the runner vs in-process; the supervisor's CPU while watching N runners."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from runner.client import RunnerClient
from runner.cpu_blas import fast_blas_environment
from runner.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from runner.engine import Engine
from supervisor.client import SupervisorClient

from .engine import PROMPTS, TOKENS
from .runner import in_process, over_grpc


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


def start_supervisor(folder: Path, n_models: int, port: int) -> subprocess.Popen:
    models = "".join(f'[models.m{i}]\ntarget = "{DEFAULT_TARGET}"\ndraft = "{DEFAULT_DRAFT}"\n' for i in range(n_models))
    config = folder / f"bench-{n_models}.toml"
    config.write_text(f'listen = "127.0.0.1:{port}"\nprobe_port = 0\nruntime_dir = "{folder}/run{n_models}"\n{models}')
    return subprocess.Popen([sys.executable, "-m", "supervisor", "serve", "--config", str(config)],
                            stderr=subprocess.DEVNULL, env=fast_blas_environment())


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
        port = free_port()
        sup = start_supervisor(folder, 1, port)
        client = SupervisorClient(f"127.0.0.1:{port}")
        try:
            assert client.wait_serving(120)
            runner = RunnerClient(f"unix://{folder}/run1/m0.sock")
            through_supervisor(client, "m0")  # warm-up
            rows = [("engine in-process", *in_process(engine)),
                    ("runner over gRPC", *over_grpc(runner)),
                    ("through the supervisor", *through_supervisor(client, "m0"))]
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
    print("\n| runners watched (1 s memory samples, 2 s health checks) | supervisor CPU while idle |")
    print("| --- | --- |")
    for n, share in cpu:
        print(f"| {n} | {share:.1f}% of one core |")
    print()
