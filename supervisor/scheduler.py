"""Which runners are alive: load on demand, LRU eviction, keep-alive unloading.

A request ``acquire``s its model: a stopped model is started (after the
memory admission check, and after evicting the least recently used idle
runner if ``max_loaded`` are already alive: with none idle, the request waits
for one, as long as it would wait for a load), the request waits while it
loads, and the runner counts it as in flight until the request ends.

While a load waits for a place, the least recently used serving runner makes
room for it: it takes no new requests (they wait, as for a load) and is
evicted once its requests in flight end. Without that, a model kept busy by a
steady stream of requests held its place until the waiting request's
deadline. A request for a model that is being stopped (evicted, unloaded,
past its keep-alive) waits for it to stop, then loads it again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import replace

import grpc

from common.settings import RunnerSettings
from common.status import ServiceError

from . import hub
from .config import ModelConfig, SupervisorConfig
from .gguf_cache import imported_folder
from .hub import parse_ref
from .memory import AdmissionRefused, Estimates, admit, batch_memory_budget, free_memory, prompt_cache_budget
from .runners import ManagedRunner, State

log = logging.getLogger("supervisor")
ROOM_POLL = 0.05  # seconds between looks for an idle runner to evict, while a load waits for one
PULLED_KEEP_ALIVE = 300.0  # seconds idle before a model served by name (not configured) is unloaded


class Scheduler:
    def __init__(self, config: SupervisorConfig, on_change=lambda runner: None):
        self.config = config
        self.estimates = Estimates()

        def changed(runner: ManagedRunner) -> None:
            if runner.info is not None:
                self.estimates.measured_runtime(runner.info.runtime_rss)
            on_change(runner)

        self._changed = changed
        # Configured models, then models a request named by hub repository (``runner``); read with list(...)
        # by other threads, since one may be added while they look.
        self.runners = {name: ManagedRunner(model, config, changed) for name, model in config.models.items()}
        self.pulls = hub.Pulls()
        self._lock = threading.Lock()
        # A load waiting for a place (max_loaded) -> the serving runner that makes room for it (takes no new
        # requests, and is evicted once those in flight end). Written under _lock; read by the front door too.
        self._making_room: dict[ManagedRunner, ManagedRunner] = {}
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._expire_idle, name="keep-alive", daemon=True)

    def start(self) -> None:
        for runner in self.runners.values():
            if runner.model.load_at_start:
                with contextlib.suppress(ServiceError):
                    self.load(runner.name, wait=False)
        self._reaper.start()

    def runner(self, name: str) -> ManagedRunner:
        """A configured model's runner, or one already adopted by name; a model in the hub cache that ``pull``
        lets a request name is adopted here (nothing fetched: ``acquire_runner`` pulls)."""
        found = self.runners.get(name)
        if found is not None:
            return found
        ref = parse_ref(name) if self.config.pull != "never" else None
        if ref is None:
            raise self._unknown(name)
        try:
            path = hub.cached(ref)
        except hub.HubError:
            raise self._unknown(name) from None
        return self._adopt(name, path)

    def _unknown(self, name: str) -> ServiceError:
        configured = ", ".join(sorted(self.config.models))
        also = {
            "never": "",
            "cached": "; or a hub repository in the hub cache (pull it first: python -m supervisor pull REPO)",
            "any": "; or a hub repository (org/name), pulled on first use",
        }[self.config.pull]
        return ServiceError(
            grpc.StatusCode.NOT_FOUND, f"no model named {name!r}; configured: {configured}{also}", "model"
        )

    def _adopt(self, name: str, path) -> ManagedRunner:
        """A runner for a hub repository named by a request, with the default settings, the memory policy,
        LRU and a keep-alive of ``PULLED_KEEP_ALIVE`` (as Ollama keeps a model it loaded on request)."""
        with self._lock:
            found = self.runners.get(name)
            if found is not None:
                return found
            settings = RunnerSettings(target=path, name=name)
            model = ModelConfig(name, settings, keep_alive=PULLED_KEEP_ALIVE, load_at_start=False)
            runner = ManagedRunner(model, self.config, self._changed)
            self.runners[name] = runner
        log.info("model %s: served by name from the hub cache (%s)", name, path)
        return runner

    def forget(self, name: str) -> None:
        """Stop and drop a model a request named by hub repository (its files are being deleted)."""
        if name in self.config.models or name not in self.runners:
            return
        self.unload(name, "deleted from the hub cache")
        with self._lock:
            self.runners.pop(name, None)

    def cached_names(self) -> list[str]:
        """Hub repositories in the hub cache a request may name (and has not yet), unless ``pull`` is never."""
        if self.config.pull == "never":
            return []
        served = {ref.repo for ref in map(parse_ref, list(self.runners)) if ref is not None}
        return [model.ref for model in hub.cached_models() if parse_ref(model.ref).repo not in served]

    def api_pull(self, name: str) -> hub.PullJob:
        """A pull asked over an API (Ollama's /api/pull, gRPC Pull): allowed under ``pull = "any"``."""
        if self.config.pull != "any":
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED,
                f'pulls over the API are off (pull = "{self.config.pull}" in the config): set pull = "any", or '
                "pull on the server's machine with python -m supervisor pull REPO",
                "model",
            )
        ref = parse_ref(name)
        if ref is None:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model: {name!r} is not a hub repository (org/name, org/name@revision, org/name:QUANT or "
                "org/name/file.gguf)",
                "model",
            )
        return self.pulls.start(ref)

    def pull_for_request(self, name: str) -> None:
        """Under ``pull = "any"``: fetch a repository a request names, waiting for it (the pull's progress is in
        the log, the metrics and ``top``); a second request for it waits for the same pull."""
        ref = parse_ref(name) if self.config.pull == "any" else None
        if ref is None or name in self.runners:
            return
        try:
            hub.cached(ref)
            return
        except hub.HubError:
            pass
        job = self.pulls.start(ref)
        job.done.wait()
        if job.error is not None:
            raise (
                job.error
                if isinstance(job.error, ServiceError)
                else ServiceError(grpc.StatusCode.UNAVAILABLE, f"pull {name}: {job.error}", "model")
            )

    def load(self, name: str, wait: bool = True, timeout: float | None = None, cancelled=None) -> ManagedRunner:
        """The model's runner, started if it is not alive (``wait``: and waited for until it serves, at most
        ``timeout`` seconds, or until ``cancelled`` - a threading.Event: its client went away - is set)."""
        runner = self.runner(name)
        if runner.model.target.suffix.lower() == ".gguf":  # a GGUF file named by a request: imported once, here
            in_use = [path for r in list(self.runners.values()) if r.active for path in (r.model.target, r.model.draft)]
            folder = imported_folder(runner.model.target, self.config.gguf_cache_dir, keep=in_use)
            runner.model = replace(runner.model, runner=replace(runner.model.runner, target=folder))
        if wait:
            # No deadline (gRPC says ~2**63 s): as long as a runner may take to start.
            if timeout is None or timeout > self.config.startup_timeout + self.config.restart_backoff_cap:
                timeout = self.config.startup_timeout + self.config.restart_backoff_cap
        deadline = time.monotonic() + timeout if wait else None
        try:
            while True:
                out_of_time = deadline is None or time.monotonic() >= deadline
                with self._lock:
                    if self._stop.is_set():
                        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"model {name}: supervisor shutting down")
                    if cancelled is not None and cancelled.is_set():  # nobody waits for it any more
                        raise ServiceError(grpc.StatusCode.CANCELLED, "client went away")
                    if runner.active:
                        # A runner being stopped, or making room for another model, takes no new requests: one
                        # that may wait does, then loads it again.
                        waiting_for = self.making_room_for(runner)
                        if deadline is None or not (runner.stopping or waiting_for):
                            break
                        if out_of_time:
                            doing = f"making room for {waiting_for}" if waiting_for else "stopping"
                            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"model {name} is {doing}")
                    # With max_loaded runners alive and none idle (each starting or answering), a request that
                    # may wait does, until one is idle or its time is up: the runner it evicts finishes first.
                    elif self._make_room(runner, refuse=out_of_time):
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
                        break
                time.sleep(ROOM_POLL)
        finally:
            with self._lock:  # whatever ended the wait (a start, a refusal, the client gone): no longer waiting
                self._making_room.pop(runner, None)
        if wait:
            state = runner.wait_serving(max(0.0, deadline - time.monotonic()))
            if state != State.SERVING:
                self._raise_for(runner)
        return runner

    def _raise_for(self, runner: ManagedRunner) -> None:
        if runner.state == State.FAILED:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, f"model {runner.name} failed: {runner.reason}")
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"model {runner.name} is {runner.state.value}: {runner.reason}")

    def _make_room(self, incoming: ManagedRunner, refuse: bool) -> bool:
        """Whether ``incoming`` may start: fewer than ``max_loaded`` runners are alive, or the least recently used
        idle one is evicted. With none idle, False (the least recently used serving one makes room: it takes no
        new requests), or (``refuse``) the error."""
        alive = [r for r in list(self.runners.values()) if r.active and r is not incoming]
        if len(alive) < self.config.loaded_cap:
            return True
        idle = sorted((r for r in alive if r.idle), key=lambda r: r.last_used)
        if not idle:
            serving = [r for r in alive if r.state == State.SERVING and not r.stopping]
            if refuse:
                raise ServiceError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(alive)} runners are loaded (max_loaded) and none is idle: "
                    + ", ".join(f"{r.name} {'answering' if r in serving else r.state.value}" for r in alive),
                )
            if serving:
                victim = min(serving, key=lambda r: r.last_used)
                if self._making_room.get(incoming) is not victim:
                    log.info(
                        "model %s: makes room for %s (max_loaded): takes no new requests, and is evicted once "
                        "its %d in flight end",
                        victim.name,
                        incoming.name,
                        victim.in_flight,
                    )
                    self._making_room[incoming] = victim
            return False
        victim = idle[0]
        log.info("model %s: evicted (least recently used) to load %s", victim.name, incoming.name)
        victim.stop(f"evicted to load {incoming.name}")
        return True

    def making_room_for(self, runner: ManagedRunner) -> str:
        """The model waiting to take ``runner``'s place (it takes no new requests meanwhile), or ''."""
        for incoming, victim in list(self._making_room.items()):
            if victim is runner:
                return incoming.name
        return ""

    def unload(self, name: str, reason: str = "unloaded on request") -> ManagedRunner:
        runner = self.runner(name)
        runner.stop(reason)
        runner.join(self.config.drain_grace + self.config.kill_timeout + 5)
        return runner

    def acquire_runner(self, name: str, timeout: float | None, cancelled=None) -> ManagedRunner:
        """The model's runner once it serves: started if stopped, waited for while it starts or restarts (the
        front door calls it on a thread of its blocking pool)."""
        self.pull_for_request(name)
        runner = self.runner(name)
        if runner.state == State.FAILED:
            self._raise_for(runner)
        runner = self.load(name, wait=True, timeout=timeout, cancelled=cancelled)
        runner.claim()
        return runner

    @contextlib.contextmanager
    def acquire(self, name: str, timeout: float | None):
        yield self.acquire_runner(name, timeout)

    def _expire_idle(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            for runner in list(self.runners.values()):
                # A request may set its own (Ollama's keep_alive; math.inf: never); else the model's setting.
                keep_alive = runner.model.keep_alive if runner.keep_alive is None else runner.keep_alive
                if keep_alive and runner.idle and now - runner.last_used > keep_alive:
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
