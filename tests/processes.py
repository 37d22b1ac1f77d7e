"""Starting real runner (and supervisor) processes for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from common.client import RunnerClient
from common.cpu_blas import fast_blas_environment
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET

REPO = Path(__file__).resolve().parent.parent


def child_environment() -> dict[str, str]:
    env = fast_blas_environment()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def terminate(process: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, SIGKILL if it is still there; the exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def serve_expecting_refusal(config: Path) -> subprocess.CompletedProcess:
    """``python -m supervisor serve`` on a config it should refuse; returns once it has exited."""
    return subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_environment(),
    )


class RunnerProcess:
    def __init__(self, socket_dir: Path, *extra: str, target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, name="default"):
        self.socket = socket_dir / f"{name}.sock"
        self.address = f"unix://{self.socket}"
        self.stderr_path = socket_dir.parent / f"{name}-{time.monotonic_ns()}.stderr"
        args = [sys.executable, "-m", "runner", "--target", str(target), "--listen", self.address, "--name", name]
        if draft is not None:
            args += ["--draft", str(draft)]
        self.process = subprocess.Popen([*args, *extra], stderr=open(self.stderr_path, "w"), env=child_environment())
        self.client = RunnerClient(self.address)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_serving(self, timeout: float = 60) -> RunnerProcess:
        if not self.client.wait_serving(timeout, alive=self.alive):
            raise AssertionError(f"runner did not become SERVING (exit {self.process.poll()}):\n{self.stderr}")
        return self

    def stop(self) -> int:
        self.client.close()
        return terminate(self.process, 30)


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SupervisorProcess:
    """``python -m supervisor serve`` on a TOML config written into ``folder``."""

    def __init__(self, folder: Path, models_toml: str, collector: bool = True, env: dict | None = None, **settings):
        """``collector=False`` starts the supervisor with Python's cyclic garbage collector off. It stands in for a
        collection that comes late, which cannot be caused on demand: anything released only when the collector
        runs then stays held, and a test that waits for its release fails every time instead of now and then."""
        from supervisor.client import SupervisorClient

        folder.mkdir(parents=True, exist_ok=True)
        self.port, self.probe_port, self.http_port = free_port(), free_port(), free_port()
        self.runtime_dir = folder / "run"
        self.kernel_cache_dir = folder / "kernels"
        top = {
            "listen": f"127.0.0.1:{self.port}",
            "probe_port": self.probe_port,
            "http_listen": f"127.0.0.1:{self.http_port}",
            "runtime_dir": str(self.runtime_dir),
            "health_period": "0.5s",
            "restart_backoff": "0.3s",
            "memory_period": "0.3s",
            "kernel_cache_dir": str(folder / "kernels"),
            **settings,
        }
        lines = [
            f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {str(v).lower() if isinstance(v, bool) else v}"
            for k, v in top.items()
        ]
        self.config = folder / "supervisor.toml"
        self.config.write_text("\n".join(lines) + "\n" + models_toml.replace("'", '"'))
        self.stderr_path = folder / f"supervisor-{time.monotonic_ns()}.stderr"
        command = ["-m", "supervisor", "serve", "--config", str(self.config)]
        if not collector:
            command[:2] = [
                "-c",
                "import gc, runpy; gc.disable(); runpy.run_module('supervisor', run_name='__main__', alter_sys=True)",
            ]
        self.process = subprocess.Popen(
            [sys.executable, *command], stderr=open(self.stderr_path, "w"), env={**child_environment(), **(env or {})}
        )
        self.token = settings.get("auth_token", "")
        self.ollama_listen = settings.get("ollama_listen", "")  # HOST:PORT, when the config sets one
        self.client = SupervisorClient(f"127.0.0.1:{self.port}", token=self.token)

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1"

    def openai(self, api_key: str | None = None, **options):
        """The official OpenAI client, pointed at this supervisor's HTTP API."""
        from openai import OpenAI

        return OpenAI(
            base_url=self.base_url,
            api_key=self.token or "none" if api_key is None else api_key,
            max_retries=0,
            timeout=300,
            **options,
        )

    def anthropic(self, api_key: str | None = None, **options):
        """The official Anthropic client, pointed at this supervisor's HTTP API (its Messages API)."""
        from anthropic import Anthropic

        return Anthropic(
            base_url=self.base_url.removesuffix("/v1"),
            api_key=self.token or "none" if api_key is None else api_key,
            max_retries=0,
            timeout=300,
            **options,
        )

    def ollama(self, host: str | None = None, timeout: float = 300):
        """The official Ollama client, pointed at this supervisor (its main HTTP port unless ``host``)."""
        import ollama

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        return ollama.Client(host=host or f"http://127.0.0.1:{self.http_port}", headers=headers, timeout=timeout)

    def wait_ready(self, timeout: float = 90) -> SupervisorProcess:
        if not self.client.wait_serving(timeout):
            raise AssertionError(f"supervisor not ready (exit {self.process.poll()}):\n{self.stderr[-3000:]}")
        return self

    def runner_pids(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.process.pid).children()]

    def probe(self, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.probe_port}{path}", timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def stop(self) -> int:
        self.client.close()
        return terminate(self.process, 60)


def model_toml(name: str, target=DEFAULT_TARGET, draft=DEFAULT_DRAFT, **settings) -> str:
    lines = [f"[models.{name}]", f"target = '{target}'"]
    if draft is not None:
        lines.append(f"draft = '{draft}'")
    for key, value in settings.items():
        lines.append(f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}")
    return "\n".join(lines) + "\n"


def resumed_on_a_new_runner(sup: SupervisorProcess, model: str, old_pid: int, timeout: float = 60) -> int:
    """The pid of ``model``'s restarted runner once it serves the resumed request (in flight on it). A chunk
    read after a death proves nothing: chunks the dead runner sent may still be in the connections' buffers."""
    from supervisor.protocol import supervisor_pb2

    found = {}

    def resumed() -> bool:
        status = sup.client.model(model)
        found["pid"] = status.pid
        serving = status.state == supervisor_pb2.RUNNER_STATE_SERVING
        return serving and status.pid not in (0, old_pid) and status.in_flight == 1

    assert wait_until(resumed, timeout, interval=0.05), f"{model}: the answer was not resumed on a new runner"
    return found["pid"]
