"""Process supervision: one runner child per model, with named states.

    STOPPED --load--> STARTING --health SERVING--> SERVING --unload/evict/keep-alive--> DRAINING --> STOPPED
                         |                           |
                         +--exits / start timeout----+--dies / hangs--> BACKOFF --> STARTING ...
                                                                            \\--too many failures--> FAILED

Each ManagedRunner has one thread that spawns its child, waits for it and
restarts it, so the child is always started from a thread that outlives it
(the runner's PR_SET_PDEATHSIG watches the spawning thread, not the process).
The same thread checks health on a period: a runner that misses several
checks is killed and restarted like one that died.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from common.client import RunnerClient
from common.cpu_blas import fast_blas_environment
from common.logs import record_from_json
from common.protocol import runner_pb2

from .config import ModelConfig, SupervisorConfig, socket_path

log = logging.getLogger("supervisor")
runner_log = logging.getLogger("supervisor.runner")  # the runners' records, read back from their stderr
STDERR_TAIL_LINES = 40
# Seconds a runner just handed to a request (or just serving, for the request that started it) is not idle, though
# nothing is in flight yet: the request's call starts within them, and an eviction meanwhile would pull the runner
# out from under it.
CLAIM_GRACE = 5.0
SERVING = health_pb2.HealthCheckResponse.SERVING


class State(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    BACKOFF = "backoff"
    FAILED = "failed"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


PTX_CACHE = "MLX_PTX_CACHE_DIR"  # where MLX's CUDA backend keeps the kernels it compiled (mlx/backend/cuda)


def runner_environment(config) -> dict[str, str]:
    """A runner's environment: the supervisor's, the CPU's fast BLAS (``common.cpu_blas``), and the kernel cache
    folder (``kernel_cache_dir``), so kernels compiled by one runner are found by the next (on the CPU, unused)."""
    env = fast_blas_environment()
    try:
        config.kernel_cache_dir.mkdir(parents=True, exist_ok=True)
        env[PTX_CACHE] = str(config.kernel_cache_dir)
    except OSError as error:  # MLX falls back to its own folder under /tmp
        log.warning("kernel_cache_dir %s cannot be made (%s): MLX keeps its own", config.kernel_cache_dir, error)
    return env


class ManagedRunner:
    def __init__(self, model: ModelConfig, config: SupervisorConfig, on_change=lambda runner: None):
        self.model = model
        self.name = model.name
        self.config = config
        self.socket = socket_path(config.runtime_dir, model.name)
        self.address = f"unix://{self.socket}"
        self._on_change = on_change
        self._cond = threading.Condition()
        self.state = State.STOPPED
        self.reason = "not loaded"
        self.process: subprocess.Popen | None = None
        self.client: RunnerClient | None = None
        self.info = None  # the serving runner's InfoResponse
        self.keep_alive: float | None = None  # idle seconds before unloading, as the last request set it (None: config)
        self.prompt_cache_budget: int | None = None  # set by the scheduler before each start
        self.batch_memory_budget: int | None = None  # likewise
        self.restarts = 0
        self.last_failure = ""  # why it last restarted (died, hung, never came up, or the memory policy), when it has
        self.last_failure_at = 0.0  # its wall-clock time
        self.starting_since: float | None = None  # monotonic time this start began, while STARTING
        self.last_load_s = 0.0  # spawn to SERVING, the last time it started
        self.failures = 0  # consecutive, reset after a stable period
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.last_used = time.monotonic()
        self.in_flight = 0
        self.claimed_at: float | None = None  # when a request was last handed it, until that request's call starts
        self._calls: set = set()
        self._wanted = False
        self._restart_reason: str | None = None
        self._stop_reason = "stopped"
        self._call_failures: dict = {}  # in-flight call -> (status, message) it ends with
        self.exited = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state ---------------------------------------------------------------

    def _set(self, state: State, reason: str) -> None:
        with self._cond:
            changed = (state, reason) != (self.state, self.reason)
            self.state, self.reason = state, reason
            if state == State.SERVING:
                self.claimed_at = time.monotonic()  # held for the request that started it, waking now
            self._cond.notify_all()
        if changed:
            log.info("model %s: %s (%s)", self.name, state.value, reason)
            self._on_change(self)

    @property
    def pid(self) -> int:
        process = self.process
        return process.pid if process is not None and process.poll() is None else 0

    @property
    def active(self) -> bool:
        """Holds (or is about to hold) a process."""
        return self.state in (State.STARTING, State.SERVING, State.DRAINING, State.BACKOFF)

    @property
    def stopping(self) -> bool:
        """Still holds a process, and has been told to stop (evicted, unloaded, idle past its keep-alive)."""
        return self.active and not self._wanted

    @property
    def idle(self) -> bool:
        """Serving with nothing in flight, and not just handed to a request (``claim``): may be evicted or expire."""
        claimed = self.claimed_at
        return (
            self.state == State.SERVING
            and self.in_flight == 0
            and (claimed is None or time.monotonic() - claimed > CLAIM_GRACE)
        )

    def claim(self) -> None:
        """A request was handed this runner and calls it next: not idle until that call starts (``track``), for at
        most ``CLAIM_GRACE`` seconds."""
        now = time.monotonic()
        self.last_used = self.claimed_at = now

    def release_claim(self) -> None:
        """The request it was handed makes no call (it only loaded the model): idle from now, its keep-alive counted
        from now, not ``CLAIM_GRACE`` seconds on."""
        with self._cond:
            self.claimed_at = None
            self.last_used = time.monotonic()

    def stderr_summary(self, lines: int = 5) -> str:
        """The runner's last words that matter: its warnings, errors and tracebacks, not its INFO log lines."""
        tail = [line.strip() for line in self.stderr_tail if line.strip()][-lines:]
        return " | ".join(tail)

    # -- requests from the scheduler, service and memory watch ---------------

    def start(self) -> None:
        with self._cond:
            if self.state == State.FAILED:
                self.failures = 0
            self._wanted = True
            self._cond.notify_all()
            if self._thread is not None and self._thread.is_alive():
                return
            self._thread = threading.Thread(target=self._supervise, name=f"runner-{self.name}", daemon=True)
        self._set(State.STARTING, "starting")  # before the thread runs: waiters must not see STOPPED
        self._thread.start()

    def wait_serving(self, timeout: float) -> State:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.state not in (State.SERVING, State.FAILED, State.STOPPED) and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            return self.state

    def stop(self, reason: str) -> None:
        with self._cond:
            self._wanted = False
            self._stop_reason = reason
            self._cond.notify_all()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def restart(self, reason: str, client_status: grpc.StatusCode, client_message: str) -> None:
        """Drain and restart (memory policy): in-flight streams end with ``client_status``."""
        with self._cond:
            if self.state != State.SERVING:
                return
            self._restart_reason = reason
            self.last_failure, self.last_failure_at = f"restarted: {reason}", time.time()
            self._cond.notify_all()
        self._fail_calls(client_status, client_message, cancel=True)

    def _fail_calls(self, status: grpc.StatusCode, message: str, cancel: bool = False) -> None:
        """Record why every in-flight stream ends, before it sees its error."""
        with self._cond:
            calls = list(self._calls)
            for call in calls:
                self._call_failures.setdefault(call, (status, message))
        if cancel:
            for call in calls:
                call.cancel()

    def failure_for(self, call) -> tuple[grpc.StatusCode, str] | None:
        with self._cond:
            return self._call_failures.get(call)

    def track(self, call) -> None:
        with self._cond:
            self._calls.add(call)
            self.in_flight = len(self._calls)
            self.claimed_at = None

    def untrack(self, call) -> None:
        with self._cond:
            self._calls.discard(call)
            self._call_failures.pop(call, None)
            self.in_flight = len(self._calls)
            self.last_used = time.monotonic()

    # -- the supervising thread -----------------------------------------------

    def _supervise(self) -> None:
        backoff = self.config.restart_backoff
        while True:
            with self._cond:
                if not self._wanted:
                    break
            started = time.monotonic()
            outcome = self._run_once()
            if outcome == "stopped":
                break
            if outcome == "restart":
                self.restarts += 1
                continue
            # The runner died, hung or never came up.
            self.restarts += 1
            self.last_failure, self.last_failure_at = outcome, time.time()
            if time.monotonic() - started > self.config.stable_after:
                self.failures, backoff = 0, self.config.restart_backoff
            self.failures += 1
            if self.failures > self.config.max_restarts:
                with self._cond:
                    self._wanted = False
                self._set(State.FAILED, f"gave up after {self.failures} failures; last: {outcome}")
                return
            self._set(State.BACKOFF, f"{outcome}; restarting in {backoff:.0f} s")
            with self._cond:
                self._cond.wait_for(lambda: not self._wanted, timeout=backoff)
            backoff = min(backoff * 2, self.config.restart_backoff_cap)
        self._set(State.STOPPED, self._stop_reason)

    def _run_once(self) -> str:
        """Start one child and follow it to its end: 'stopped', 'restart' or a failure description."""
        self.exited.clear()
        try:
            self.process = self._spawn()
        except OSError as error:
            return f"cannot start: {error}"
        self.client = RunnerClient(self.address)
        self.starting_since = time.monotonic()
        self._set(State.STARTING, f"pid {self.process.pid}")
        try:
            failure = self._wait_until_serving()
            if failure is not None:
                self.starting_since = None
                self._kill()
                return failure
            try:
                self.info = self.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
            except grpc.RpcError:
                self.info = None
            if self.starting_since is not None:
                self.last_load_s = time.monotonic() - self.starting_since
            self.starting_since = None
            self._set(State.SERVING, f"pid {self.process.pid}")
            return self._watch()
        finally:
            self._reap()

    def _spawn(self) -> subprocess.Popen:
        # The model's settings, with what the supervisor decides at each start: the memory budgets, the grace.
        settings = replace(self.model.runner, grace=self.config.drain_grace)
        if self.prompt_cache_budget is not None:
            settings = replace(settings, prompt_cache=self.prompt_cache_budget)
        if self.batch_memory_budget is not None:
            settings = replace(settings, batch_memory=max(1, self.batch_memory_budget))
        args = [
            sys.executable,
            "-m",
            "runner",
            "--listen",
            self.address,
            "--parent-pid",
            str(os.getpid()),
            "--log-format",
            "json",
            *settings.to_argv(),
        ]
        self.stderr_tail.clear()
        process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=runner_environment(self.config),
            start_new_session=True,
            text=True,
            errors="replace",
        )
        threading.Thread(target=self._forward_stderr, args=(process,), name=f"stderr-{self.name}", daemon=True).start()
        return process

    def _forward_stderr(self, process: subprocess.Popen) -> None:
        """Each of the runner's log records (JSON lines) as a record of the supervisor's log, with the model and
        pid as fields (``common.logs``); its warnings, errors and stray lines are kept for failure reports."""
        for line in process.stderr:
            record = record_from_json(line.rstrip("\n"), self.name, process.pid)
            if record.levelno > logging.INFO:
                self.stderr_tail.append(record.getMessage())
            runner_log.handle(record)

    def _died(self) -> str:
        code = self.process.wait()
        time.sleep(0.05)  # let the stderr reader catch the last lines
        detail = self.stderr_summary()
        return f"runner {describe_exit(code)}" + (f": {detail}" if detail else "")

    def _wait_until_serving(self) -> str | None:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return self._died()
            with self._cond:
                if not self._wanted:
                    return None
            if self.client.health_status(timeout=0.5) == SERVING:
                return None
            time.sleep(0.05)
        return f"runner not serving after {self.config.startup_timeout:.0f} s"

    def _watch(self) -> str:
        """While SERVING: wait for exit, a stop or restart request, or missed health checks."""
        misses = 0
        next_check = time.monotonic() + self.config.health_period
        while True:
            with self._cond:
                self._cond.wait_for(lambda: not self._wanted or self._restart_reason is not None, timeout=0.05)
                wanted, restart_reason = self._wanted, self._restart_reason
                self._restart_reason = None
            if self.process.poll() is not None:
                cause = self._died()
                self._fail_calls(grpc.StatusCode.UNAVAILABLE, f"model {self.name}: {cause}")
                self.exited.set()
                return cause
            if not wanted:
                self._drain(self._stop_reason)
                return "stopped"
            if restart_reason is not None:
                self._drain(restart_reason)
                return "restart"
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + self.config.health_period
                if self.client.health_status(timeout=self.config.health_deadline) == SERVING:
                    misses = 0
                    continue
                if self.process.poll() is not None:
                    continue
                misses += 1
                if misses >= self.config.health_misses:
                    cause = f"runner hung: missed {misses} health checks of {self.config.health_deadline:.1f} s"
                    self._fail_calls(grpc.StatusCode.UNAVAILABLE, f"model {self.name}: {cause}")
                    self._kill()
                    self.exited.set()
                    return cause

    def _drain(self, reason: str) -> None:
        """SIGTERM: the runner finishes in-flight work within its grace; SIGKILL after that."""
        self._set(State.DRAINING, reason)
        self._signal(signal.SIGTERM)
        try:
            self.process.wait(self.config.drain_grace + self.config.kill_timeout)
        except subprocess.TimeoutExpired:
            log.warning("model %s: runner did not stop in time: SIGKILL", self.name)
            self._kill()
        self.exited.set()

    def _signal(self, signum) -> None:
        try:
            os.killpg(self.process.pid, signum)  # its own process group: the whole tree
        except ProcessLookupError:
            pass

    def _kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGKILL)
            self.process.wait()

    def _reap(self) -> None:
        if self.process is not None:
            self._kill()
            self.process.wait()
        if self.client is not None:
            self.client.close()
        Path(self.socket).unlink(missing_ok=True)
