"""The front door: one asyncio loop, on its own thread, that relays every client's chunks.

The public gRPC API (grpc.aio), the HTTP APIs (uvicorn) and the channels to the
runners (grpc.aio again) all live on this one loop. A chunk goes from the
runner's stream to the client's without leaving it: no thread waits on a
runner stream and no chunk is handed from a thread to the loop. The old relay
(a sync gRPC server with a thread per stream; uvicorn waiting on a worker thread
for each chunk) cost 190 us of supervisor CPU per relayed gRPC chunk and 250 us
per HTTP one, 5-14% of the aggregate tok/s at 16 clients on a 2-core machine,
where that CPU comes out of the batched step (bench/front_door.py, docs/benchmarks.md).

What still blocks (waiting for a model to load, unloading one, counting a
prompt's tokens, the health service's Watch) runs on the ``blocking`` pool, once
per request, never per chunk. Everything else in the supervisor (each runner's
supervising thread, the memory watch, the keep-alive reaper) stays on threads
and reaches the loop only through ``RunnerCall.cancel``, which is thread-safe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading

import grpc

from common.client import RECONNECT_OPTIONS
from common.defaults import CHANNEL_OPTIONS
from common.protocol import runner_pb2_grpc

from .runners import ManagedRunner, State

log = logging.getLogger("supervisor")

# No bandwidth-delay probing on the runner channels: with it, gRPC grows a stream's receive window while the
# supervisor is not reading it (a slow client), and the runner's chunks pile up here, in the supervisor (measured:
# the whole answer). With the fixed 64 KiB window, a stream the supervisor stops reading stops the runner's
# sender, and the rounds wait in the runner, bounded by its ``max_pending_rounds``. A unix socket needs no more.
RUNNER_CHANNEL_OPTIONS = CHANNEL_OPTIONS + RECONNECT_OPTIONS + [("grpc.http2.bdp_probe", 0)]


class RunnerCall:
    """A runner Generate call made on the loop; ``cancel`` may come from any thread (the memory policy's
    restart cancels every call in flight). Tracked by its runner (``ManagedRunner.track``) while it streams."""

    __slots__ = ("call", "loop", "cancelled")

    def __init__(self, call, loop: asyncio.AbstractEventLoop):
        self.call, self.loop, self.cancelled = call, loop, False

    def cancel(self) -> None:
        self.cancelled = True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.call.cancel()
        else:
            try:
                self.loop.call_soon_threadsafe(self.call.cancel)
            except RuntimeError:  # the loop is closed: so is the call
                pass


class FrontDoor:
    def __init__(self, blocking_threads: int):
        self.loop = asyncio.new_event_loop()
        self.blocking = concurrent.futures.ThreadPoolExecutor(blocking_threads, thread_name_prefix="blocking")
        self.loop.set_default_executor(self.blocking)
        self._channels: dict[str, tuple[object, grpc.aio.Channel, runner_pb2_grpc.RunnerStub]] = {}
        self._thread = threading.Thread(target=self._run, name="front-door", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        self._thread.start()

    def call(self, coroutine, timeout: float | None = None):
        """Run ``coroutine`` on the loop from another thread and wait for its result."""
        return self.submit(coroutine).result(timeout)

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    async def blocking_call(self, function, *args, **kwargs):
        return await self.loop.run_in_executor(self.blocking, functools.partial(function, *args, **kwargs))

    # -- runners ----------------------------------------------------------------------------------------------

    async def acquire(self, scheduler, name: str, timeout: float | None, cancelled=None) -> ManagedRunner:
        """The model's runner, serving: at once when it is, else loaded or waited for on the blocking pool (until
        ``cancelled``, a threading.Event, is set, or the awaiting task is cancelled: the client went away)."""
        runner = scheduler.runners.get(name)
        if runner is not None and runner.state == State.SERVING and not scheduler.making_room_for(runner):
            # Nothing to wait for, and nothing here may wait: the loop serves every client. Should the runner
            # go away now, its call fails and the generation sends the request again once it is back.
            runner.claim()
            return runner
        gone = cancelled if cancelled is not None else threading.Event()
        try:
            return await self.blocking_call(scheduler.acquire_runner, name, timeout, gone)
        except asyncio.CancelledError:
            # The blocking thread would wait on to the deadline, and a runner making room for this request would
            # take no new ones meanwhile (an embedding or rerank call has no event of its own: its task is
            # cancelled when its client goes away).
            gone.set()
            raise

    def stub(self, runner: ManagedRunner) -> runner_pb2_grpc.RunnerStub:
        """The runner's stub on this loop: one channel per runner process (a restarted runner gets a new one, so
        no call waits out a reconnect backoff to a socket that was gone). On the loop only."""
        client = runner.client
        cached = self._channels.get(runner.name)
        if cached is not None and cached[0] is client:
            return cached[2]
        if cached is not None:  # the process it spoke to is gone: so are its calls
            self.loop.create_task(cached[1].close(grace=1.0))
        channel = grpc.aio.insecure_channel(runner.address, options=RUNNER_CHANNEL_OPTIONS)
        stub = runner_pb2_grpc.RunnerStub(channel)
        self._channels[runner.name] = (client, channel, stub)
        return stub

    def connect(self, runner: ManagedRunner) -> None:
        """Open the runner's channel now it serves, from any thread: the connection is made while its socket
        file is there (a live connection outlives the file; a new one would not find it)."""

        def on_loop() -> None:
            if runner.client is not None and runner.state == State.SERVING:
                self.stub(runner)
                self._channels[runner.name][1].get_state(try_to_connect=True)

        try:
            self.loop.call_soon_threadsafe(on_loop)
        except RuntimeError:  # the loop is closed: the supervisor is stopping
            pass

    def runner_call(self, runner: ManagedRunner, request, timeout: float | None) -> RunnerCall:
        return RunnerCall(self.stub(runner).Generate(request, timeout=timeout), self.loop)

    # -- stopping -----------------------------------------------------------------------------------------------

    def stop(self, timeout: float = 5.0) -> None:
        """Close the runner channels, stop the loop and its thread."""
        if not self._thread.is_alive():
            return

        async def close() -> None:
            for _, channel, _ in self._channels.values():
                await channel.close()
            self._channels.clear()

        try:
            self.call(close(), timeout)
        except (concurrent.futures.TimeoutError, RuntimeError) as error:
            log.warning("front door: runner channels not closed in time (%s)", error)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self.blocking.shutdown(wait=False, cancel_futures=True)
