"""Starting real runner (and supervisor) processes for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from runner.client import RunnerClient
from runner.cpu_blas import fast_blas_environment
from runner.defaults import DEFAULT_DRAFT, DEFAULT_TARGET

REPO = Path(__file__).resolve().parent.parent


def child_environment() -> dict[str, str]:
    env = fast_blas_environment()
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


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

    def wait_serving(self, timeout: float = 60) -> "RunnerProcess":
        if not self.client.wait_serving(timeout, alive=self.alive):
            raise AssertionError(f"runner did not become SERVING (exit {self.process.poll()}):\n{self.stderr}")
        return self

    def stop(self) -> int:
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.client.close()
        return self.process.returncode


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
