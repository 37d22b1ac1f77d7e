"""Which runners are alive: load on demand, LRU eviction, keep-alive unloading.

A request ``acquire``s its model: a stopped model is started (after the
memory admission check, and after evicting the least recently used idle
runner if ``max_loaded`` are already alive), the request waits while it
loads, and the runner counts it as in flight until the request ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import grpc

from common.status import ServiceError

from .config import SupervisorConfig
from .memory import AdmissionRefused, Estimates, admit, batch_memory_budget, free_memory, prompt_cache_budget
from .runners import ManagedRunner, State

log = logging.getLogger("supervisor")


class Scheduler:
    def __init__(self, config: SupervisorConfig, on_change=lambda runner: None):
        self.config = config
        self.estimates = Estimates()

        def changed(runner: ManagedRunner) -> None:
            if runner.info is not None:
                self.estimates.measured_runtime(runner.info.runtime_rss)
            on_change(runner)

        self.runners = {name: ManagedRunner(model, config, changed) for name, model in config.models.items()}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._expire_idle, name="keep-alive", daemon=True)

    def start(self) -> None:
        for runner in self.runners.values():
            if runner.model.load_at_start:
                with contextlib.suppress(ServiceError):
                    self.load(runner.name, wait=False)
        self._reaper.start()

    def runner(self, name: str) -> ManagedRunner:
        if name not in self.runners:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"no model named {name!r}; configured: {', '.join(sorted(self.runners))}",
                "model",
            )
        return self.runners[name]

    def load(self, name: str, wait: bool = True, timeout: float | None = None) -> ManagedRunner:
        runner = self.runner(name)
        with self._lock:
            if not runner.active:
                self._make_room(runner)
                available = free_memory()  # one reading for the admission and both budgets
                try:
                    needed = admit(runner.model, self.estimates, available)
                except AdmissionRefused as error:
                    raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from None
                runner.prompt_cache_budget = prompt_cache_budget(runner.model, needed, available)
                runner.batch_memory_budget = batch_memory_budget(
                    runner.model, needed, runner.prompt_cache_budget, available
                )
                runner.start()
        if wait:
            # No deadline (gRPC says ~2**63 s): as long as a runner may take to start.
            if timeout is None or timeout > self.config.startup_timeout + self.config.restart_backoff_cap:
                timeout = self.config.startup_timeout + self.config.restart_backoff_cap
            state = runner.wait_serving(timeout)
            if state != State.SERVING:
                self._raise_for(runner)
        return runner

    def _raise_for(self, runner: ManagedRunner) -> None:
        if runner.state == State.FAILED:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"model {runner.name} failed: {runner.reason}")
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"model {runner.name} is {runner.state.value}: {runner.reason}")

    def _make_room(self, incoming: ManagedRunner) -> None:
        alive = [r for r in self.runners.values() if r.active and r is not incoming]
        if len(alive) < self.config.loaded_cap:
            return
        idle = sorted((r for r in alive if r.in_flight == 0 and r.state == State.SERVING), key=lambda r: r.last_used)
        if not idle:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"{len(alive)} runners are loaded (max_loaded) and none is idle"
            )
        victim = idle[0]
        log.info("model %s: evicted (least recently used) to load %s", victim.name, incoming.name)
        victim.stop(f"evicted to load {incoming.name}")

    def unload(self, name: str, reason: str = "unloaded on request") -> ManagedRunner:
        runner = self.runner(name)
        runner.stop(reason)
        runner.join(self.config.drain_grace + self.config.kill_timeout + 5)
        return runner

    def acquire_runner(self, name: str, timeout: float | None) -> ManagedRunner:
        """The model's runner once it serves: started if stopped, waited for while it starts or restarts (the
        front door calls it on a thread of its blocking pool)."""
        runner = self.runner(name)
        if runner.state == State.FAILED:
            self._raise_for(runner)
        runner = self.load(name, wait=True, timeout=timeout)
        runner.last_used = time.monotonic()
        return runner

    @contextlib.contextmanager
    def acquire(self, name: str, timeout: float | None):
        yield self.acquire_runner(name, timeout)

    def _expire_idle(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for runner in self.runners.values():
                # A request may set its own (Ollama's keep_alive; math.inf: never); else the model's setting.
                keep_alive = runner.model.keep_alive if runner.keep_alive is None else runner.keep_alive
                if (
                    keep_alive
                    and runner.state == State.SERVING
                    and runner.in_flight == 0
                    and now - runner.last_used > keep_alive
                ):
                    runner.stop(f"idle for {keep_alive:.0f} s (keep_alive)")

    def stop_all(self) -> None:
        self._stop.set()
        for runner in self.runners.values():
            runner.stop("supervisor shutting down")
        for runner in self.runners.values():
            runner.join(self.config.drain_grace + self.config.kill_timeout + 5)

    @property
    def ready(self) -> bool:
        return all(r.state == State.SERVING for r in self.runners.values() if r.model.load_at_start)
