"""The MLX thread: every MLX call of the runner happens here, one generation at a time.

gRPC handler threads submit ``GenerationJob``s (FIFO, bounded) and control
tasks (``call``). Control tasks run when the thread is idle or between two
rounds of the generation in flight, so a pool release never races the decode
loop and never waits for a long generation to finish.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from .engine import Engine, Round
from .errors import EngineError, QueueFull, WorkerStopped
from .request import PreparedRequest

log = logging.getLogger("runner")


@dataclass
class GenerationJob:
    request: PreparedRequest
    rounds: queue.Queue = field(default_factory=queue.Queue)  # Round, an exception, or None at the end
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def results(self):
        """Rounds as the MLX thread produces them; re-raises its error."""
        while True:
            item = self.rounds.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class MlxWorker:
    def __init__(self, engine: Engine, max_queue: int, on_fatal=None, name: str = "runner"):
        self.engine = engine
        self.name = name
        self.max_queue = max_queue
        self._on_fatal = on_fatal or (lambda error: None)
        self._lock = threading.Condition()
        self._jobs: collections.deque[GenerationJob] = collections.deque()
        self._controls: collections.deque[tuple[callable, Future]] = collections.deque()
        self._current: GenerationJob | None = None
        self._stopping = False
        self.heartbeat = time.monotonic()  # last sign of life of the MLX thread
        self._thread = threading.Thread(target=self._run, name="mlx", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from gRPC threads --------------------------------------------

    def submit(self, request: PreparedRequest) -> GenerationJob:
        job = GenerationJob(request)
        with self._lock:
            if self._stopping:
                raise WorkerStopped(f"runner {self.name}: shutting down")
            waiting = len(self._jobs) - (0 if self._current is not None else 1)  # an idle thread takes one at once
            if waiting >= self.max_queue:
                raise QueueFull(f"runner {self.name}: {self.max_queue} requests already waiting")
            self._jobs.append(job)
            self._lock.notify()
        return job

    def call(self, fn) -> Future:
        """Run ``fn()`` on the MLX thread at the next safe point."""
        future: Future = Future()
        with self._lock:
            if self._stopping and not self._thread.is_alive():
                raise WorkerStopped(f"runner {self.name}: shutting down")
            self._controls.append((fn, future))
            self._lock.notify()
        return future

    @property
    def queued(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        return self._current is not None

    def stop(self, cancel_running: bool) -> None:
        """Take no new work; cancel the waiting jobs (and the running one if asked)."""
        with self._lock:
            self._stopping = True
            waiting = list(self._jobs)
            self._jobs.clear()
            running = self._current
            self._lock.notify()
        for job in waiting:
            job.rounds.put(WorkerStopped(f"runner {self.name}: shutting down"))
        if cancel_running and running is not None:
            running.cancel()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the MLX thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._jobs or self._controls or self._stopping):
                    self.heartbeat = time.monotonic()
                    self._lock.wait(0.5)
                self.heartbeat = time.monotonic()
                if not self._jobs and not self._controls and self._stopping:
                    return
                job = self._jobs.popleft() if self._jobs and not self._controls else None
                self._current = job
            if job is None:
                self._run_controls()
            else:
                self._generate(job)

    def _run_controls(self) -> None:
        while True:
            with self._lock:
                if not self._controls:
                    return
                fn, future = self._controls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                    self.heartbeat = time.monotonic()
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)

    def stalled_for(self) -> float:
        """Seconds since the MLX thread last showed progress (0 while it does)."""
        return time.monotonic() - self.heartbeat

    def _between_rounds(self, job: GenerationJob) -> bool:
        self.heartbeat = time.monotonic()
        self._run_controls()
        return job.cancelled.is_set()

    def _generate(self, job: GenerationJob) -> None:
        request_id = job.request.request_id or "-"
        try:
            if job.cancelled.is_set():
                return
            log.info("request %s: start", request_id)
            last: Round | None = None
            for last in self.engine.generate(job.request, cancelled=lambda: self._between_rounds(job)):
                job.rounds.put(last)
            if last is not None and last.stats is not None:
                s = last.stats
                log.info("request %s: %s after %d tokens, %d rounds, acceptance %.2f, %.0f tok/s, releases %s",
                         request_id, last.finish_reason, s.generated_tokens, s.rounds, s.acceptance_rate,
                         s.tokens_per_second, s.release_positions)
        except EngineError as error:
            job.rounds.put(error)
        except BaseException as error:  # noqa: BLE001 - MLX state can no longer be trusted
            log.error("request %s: engine failure: %s: %s", request_id, type(error).__name__, error)
            job.rounds.put(error)
            self._on_fatal(error)
        finally:
            job.rounds.put(None)
            with self._lock:
                self._current = None
