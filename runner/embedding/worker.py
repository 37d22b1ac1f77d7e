"""The MLX thread of an embedding runner: the rows of every request waiting are packed into batches together.

Each request (a ``Job``) brings its rows, already tokenized on its gRPC thread. Whenever the thread is free it
takes every job waiting, sorts all their rows by length (so a batch pads little), cuts them into batches of
``EmbeddingEngine.batch_width`` rows, runs each and hands every job its results once its last row is done. A
job whose caller went away (cancelled) has its rows dropped from the batches not yet run. Jobs beyond
``max_queue`` waiting are refused (QueueFull: RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import numpy as np

from common.errors import QueueFull, WorkerStopped

log = logging.getLogger("runner")


class Job:
    def __init__(self, rows: list):
        self.rows = rows
        self.results: list = [None] * len(rows)
        self.left = len(rows)
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EmbeddingWorker:
    def __init__(self, engine, max_queue: int, on_fatal=lambda error: None):
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = engine.settings.embed_batch
        self.on_fatal = on_fatal
        self._jobs: list[Job] = []
        self._calls: list = []  # (function, future) to run on this thread between batches
        self._cond = threading.Condition()
        self._stopping = False
        self.busy = False
        self.active = 0  # rows being run
        self.batches = 0
        self.rows_run = 0
        self._progress = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="mlx-embed", daemon=True)

    @property
    def queued(self) -> int:
        return len(self._jobs)

    def start(self) -> None:
        self._thread.start()

    def submit(self, rows: list) -> Job:
        job = Job(rows)
        with self._cond:
            if self._stopping:
                raise WorkerStopped("the runner is stopping")
            if len(self._jobs) >= max(1, self.max_queue):
                raise QueueFull(f"{len(self._jobs)} requests waiting: the queue is full")
            self._jobs.append(job)
            self._cond.notify()
        return job

    def call(self, function) -> concurrent.futures.Future:
        """Run ``function`` on the MLX thread between batches."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((function, future))
            self._cond.notify()
        return future

    def stalled_for(self) -> float:
        return time.monotonic() - self._progress if self.busy else 0.0

    def stop(self, cancel_running: bool = False) -> None:
        with self._cond:
            self._stopping = True
            if cancel_running:
                for job in self._jobs:
                    job.cancel()
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._calls or self._stopping)
                calls, self._calls = self._calls, []
                jobs, self._jobs = self._jobs, []
                if self._stopping and not jobs and not calls:
                    return
                self.busy = True
                self._progress = time.monotonic()
            for function, future in calls:
                try:
                    future.set_result(function())
                except BaseException as error:  # noqa: BLE001 - the caller gets it
                    future.set_exception(error)
            try:
                self._run_jobs([job for job in jobs if not job.cancelled])
            except Exception as error:  # noqa: BLE001 - MLX failed: every waiting caller hears it, the runner stops
                log.exception("embedding batch failed")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(WorkerStopped(f"the forward pass failed: {error}"))
                self.on_fatal(error)
                return
            finally:
                self.busy = False
                self.active = 0

    def _run_jobs(self, jobs: list[Job]) -> None:
        rows = sorted(
            ((len(row.ids), job, i) for job in jobs for i, row in enumerate(job.rows)), key=lambda item: item[0]
        )
        start = 0
        while start < len(rows):
            width = self.engine.batch_width(rows[min(len(rows), start + self.max_batch) - 1][0])
            batch = [item for item in rows[start : start + width] if not item[1].cancelled]
            start += width
            if not batch:
                continue
            self.active = len(batch)
            out = self.engine.run([job.rows[i] for _, job, i in batch])
            self.batches += 1
            self.rows_run += len(batch)
            self._progress = time.monotonic()
            for (_, job, i), value in zip(batch, out):
                job.results[i] = value
                job.left -= 1
                if job.left == 0 and not job.future.done():
                    job.future.set_result(np.stack(job.results) if job.results[0].ndim else np.array(job.results))
