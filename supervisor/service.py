"""The public gRPC API (proto/supervisor.proto) and the supervisor's wiring and shutdown.

The gRPC API, the HTTP APIs and the runner channels that relay generations all run on one asyncio loop, the
front door (``supervisor.front_door``); the rest of the supervisor (runner supervision, the memory watch, the
scheduler) runs on threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time

import grpc
import grpc.aio
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import __version__
from common.defaults import CHANNEL_OPTIONS
from common.status import AsyncStatusInterceptor

from . import embeddings, hub
from .config import SupervisorConfig, resolve_gguf, resolve_hub
from .front_door import FrontDoor
from .generation import Generation, count_tokens
from .memory import MemoryWatch, RunnerMemory
from .notify import ServiceNotifier
from .probes import Metrics, ProbeServer
from .protocol import supervisor_pb2, supervisor_pb2_grpc
from .runners import ManagedRunner, State
from .scheduler import Scheduler

log = logging.getLogger("supervisor")

SERVICE_NAME = supervisor_pb2.DESCRIPTOR.services_by_name["Supervisor"].full_name
# A health service name that is SERVING from start to shutdown, whatever the runners do: what a liveness
# probe asks (the overall name "" is SERVING only when every model loaded at start serves: readiness). A
# runner's crash is the supervisor's to handle; a liveness probe that followed it would kill the whole pod.
LIVENESS_SERVICE = "mlxserve.liveness"
STATES = {s: getattr(supervisor_pb2, f"RUNNER_STATE_{s.name}") for s in State}


class SupervisorService(supervisor_pb2_grpc.SupervisorServicer):
    """Handlers raise ServiceError; AsyncStatusInterceptor gives each its gRPC status. They run on the front
    door's loop: what may block (loading, unloading) goes to its blocking pool."""

    def __init__(self, supervisor: Supervisor):
        self.sup = supervisor

    async def Generate(self, request, context):
        generation = self.sup.generate(request, timeout=context.time_remaining())
        context.add_done_callback(lambda _: generation.cancel())  # client gone or deadline passed
        async for chunk in generation:
            yield chunk

    async def Embed(self, request, context):
        return await embeddings.embed(self.sup, request, context.time_remaining())

    async def Rerank(self, request, context):
        return await embeddings.rerank(self.sup, request, context.time_remaining())

    async def ListModels(self, request, context):
        return supervisor_pb2.ListModelsResponse(
            models=[self.sup.status(r) for r in list(self.sup.scheduler.runners.values())]
        )

    async def LoadModel(self, request, context):
        runner = await self.sup.front.blocking_call(
            self.sup.scheduler.load, request.model, wait=True, timeout=context.time_remaining()
        )
        return self.sup.status(runner)

    async def UnloadModel(self, request, context):
        return self.sup.status(await self.sup.front.blocking_call(self.sup.scheduler.unload, request.model))

    async def GetMemory(self, request, context):
        runners = self.sup.scheduler.runners
        if request.model:
            selected = [self.sup.scheduler.runner(request.model)]
        else:
            selected = list(runners.values())
        vm = psutil.virtual_memory()
        return supervisor_pb2.GetMemoryResponse(
            models=[self.sup.status(r) for r in selected],
            system_available=vm.available,
            system_total=vm.total,
            supervisor_rss=psutil.Process().memory_info().rss,
        )

    async def GetStatus(self, request, context):
        sup = self.sup
        return supervisor_pb2.GetStatusResponse(
            version=__version__,
            pid=os.getpid(),
            uptime_s=time.monotonic() - sup.started,
            ready=sup.scheduler.ready,
            models=[sup.status(r) for r in list(sup.scheduler.runners.values())],
            max_loaded=sup.config.loaded_cap,
            pulls=[pull_status(job) for job in sup.scheduler.pulls.in_flight()],
            cached=await sup.front.blocking_call(sup.scheduler.cached_names),
        )

    async def Pull(self, request, context):
        job = self.sup.scheduler.api_pull(request.model)
        async for progress in hub.follow(job):
            yield supervisor_pb2.PullProgress(
                status=progress.status,
                file=progress.file,
                digest=progress.digest,
                total=progress.total,
                completed=progress.completed,
            )


def pull_status(job: hub.PullJob) -> supervisor_pb2.PullStatus:
    steps = list(job.latest.values())
    completed, total = job.bytes
    return supervisor_pb2.PullStatus(
        model=str(job.ref), total=total, completed=completed, status=steps[-1].status if steps else "starting"
    )


class BearerToken(grpc.aio.ServerInterceptor):
    """Every RPC but health needs ``authorization: Bearer TOKEN`` when a token is configured."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}"

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return await continuation(details)
        if dict(details.invocation_metadata).get("authorization") == self.expected:
            return await continuation(details)
        return self._deny_stream if details.method.endswith(("/Generate", "/Pull")) else self._deny


class Supervisor:
    def __init__(self, config: SupervisorConfig):
        """Raises ConfigError when a hub reference cannot be served (``resolve_hub``: found in the hub cache, or
        pulled) or a .gguf file cannot be imported (``resolve_gguf``)."""
        self.config = config = resolve_gguf(resolve_hub(config))
        self.started = time.monotonic()
        self.started_at = time.time()
        self.shutting_down = threading.Event()
        self.metrics = Metrics()
        for name, model in config.models.items():
            self.metrics.soft_limit.labels(name).set(model.soft_limit or 0)
            self.metrics.hard_limit.labels(name).set(model.hard_limit or 0)
        self.health = health.HealthServicer()
        prepare_runtime_dir(config.runtime_dir)
        self.scheduler = Scheduler(config, on_change=self._on_runner_change)
        self.scheduler.pulls.watch = self._on_pull
        self.memory = MemoryWatch(self.scheduler.runners, config.memory_period, on_sample=self._on_memory)
        interceptors = ([BearerToken(config.auth_token)] if config.auth_token else []) + [AsyncStatusInterceptor()]
        # Streams in flight: every model's batch and queue, and room for the rest. None holds a thread; the
        # blocking pool runs waits for a model to load (one per request at most) and health Watch streams.
        streams = min(2048, sum(m.runner.max_batch + m.runner.max_queue for m in config.models.values()))
        self.front = FrontDoor(blocking_threads=streams + 32)
        self.front.start()
        self.server, port = self.front.call(self._public_server(interceptors, streams + 64))
        if port == 0 and not config.listen.startswith("unix:"):
            self.front.stop()
            raise OSError(f"cannot listen on {config.listen}")
        self.port = port
        self.probes = (
            ProbeServer(config.probe_port, self.metrics, self._readiness, config.probe_host)
            if config.probe_port
            else None
        )
        self.http = None
        self.ollama_http = None  # the same APIs where Ollama's clients look (ollama_listen)
        from .http_api import HttpServer, create_app

        def http_server(address: str):
            return HttpServer(
                create_app(self),
                address,
                config.tls_cert,
                config.tls_key,
                grace=config.drain_grace + config.kill_timeout,
            )

        if config.http_listen:
            self.http = http_server(config.http_listen)
        if config.ollama_listen:
            self.ollama_http = http_server(config.ollama_listen)
        self._stopped = threading.Event()
        self.notifier = ServiceNotifier.from_environment()  # systemd's Type=notify; nothing without NOTIFY_SOCKET

    async def _public_server(self, interceptors, max_streams: int):
        """The public gRPC server, made on the front door's loop (grpc.aio binds a server to the loop it is made
        on). Returns it and its port; a port that cannot be bound raises here, at start-up."""
        config = self.config
        server = grpc.aio.server(
            migration_thread_pool=self.front.blocking,  # the health service's sync handlers
            options=CHANNEL_OPTIONS,
            interceptors=interceptors,
            maximum_concurrent_rpcs=max_streams,
        )
        supervisor_pb2_grpc.add_SupervisorServicer_to_server(SupervisorService(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            if config.tls_cert:
                credentials = grpc.ssl_server_credentials([(config.tls_key.read_bytes(), config.tls_cert.read_bytes())])
                port = server.add_secure_port(config.listen, credentials)
            else:
                port = server.add_insecure_port(config.listen)
        except RuntimeError:  # grpc.aio raises where the sync server returned 0
            port = 0
        return server, port

    def generate(self, request, timeout: float | None) -> Generation:
        """The one internal path of a generation, for the gRPC and the HTTP API alike."""
        return Generation(self, request, timeout)

    def count_tokens(self, request) -> int:
        """The prompt's tokens as ``generate`` would lay ``request`` out (the model loaded on demand)."""
        return count_tokens(self, request)

    # -- state reporting ------------------------------------------------------

    def _on_runner_change(self, runner: ManagedRunner) -> None:
        serving = runner.state == State.SERVING
        if serving:
            self.front.connect(runner)
        self.health.set(
            runner.name,
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        self.metrics.serving.labels(runner.name).set(1 if serving else 0)
        self.metrics.restarts.labels(runner.name).set(runner.restarts)
        if not self._stopped.is_set():
            overall = (
                health_pb2.HealthCheckResponse.SERVING
                if self.scheduler.ready
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            for name in ("", SERVICE_NAME):
                self.health.set(name, overall)

    def _on_pull(self, job: hub.PullJob) -> None:
        """A pull's bytes in the metrics while it runs; gone once it ends."""
        name = str(job.ref)
        if job.done.is_set():
            for gauge in (self.metrics.pull_completed, self.metrics.pull_total):
                with contextlib.suppress(KeyError):
                    gauge.remove(name)
            return
        completed, total = job.bytes
        self.metrics.pull_completed.labels(name).set(completed)
        self.metrics.pull_total.labels(name).set(total)

    def _on_memory(self, name: str, memory: RunnerMemory) -> None:
        m, s = self.metrics, memory.current
        m.rss.labels(name).set(s.rss)
        m.anonymous.labels(name).set(s.anonymous)
        m.mlx_cache.labels(name).set(memory.mlx.cache)
        m.mlx_active.labels(name).set(memory.mlx.active)
        m.releases.labels(name).set(memory.mlx.releases)
        m.soft_releases.labels(name).set(memory.soft_releases)
        m.active_requests.labels(name).set(memory.mlx.active_requests)
        m.queued_requests.labels(name).set(memory.mlx.queued)
        cache = memory.mlx.prompt_cache
        if cache is not None:
            m.prompt_cache_entries.labels(name).set(cache.entries)
            m.prompt_cache_bytes.labels(name).set(cache.bytes)
            m.prompt_cache_hits.labels(name).set(cache.hits)
            m.prompt_cache_reused.labels(name).set(cache.reused_tokens)
            m.prompt_cache_evictions.labels(name).set(cache.evictions)

    def _readiness(self) -> tuple[bool, str]:
        states = ", ".join(f"{r.name}={r.state.value}" for r in list(self.scheduler.runners.values()))
        return self.scheduler.ready, ("ready: " if self.scheduler.ready else "not ready: ") + states

    def _estimate(self, runner: ManagedRunner) -> int:
        try:
            return self.scheduler.estimates.of(runner.model)[0].total
        except (OSError, ValueError, KeyError):
            return 0

    def status(self, runner: ManagedRunner) -> supervisor_pb2.ModelStatus:
        memory = self.memory.memory.get(runner.name) or RunnerMemory()
        current = memory.current
        sample = supervisor_pb2.MemorySample(
            peak_rss=memory.peak_rss,
            growth_bytes_per_s=memory.growth_rate,
            mlx_active=memory.mlx.active,
            mlx_cache=memory.mlx.cache,
            mlx_peak=memory.mlx.peak,
            mlx_releases=memory.mlx.releases,
            soft_limit=runner.model.soft_limit,
            hard_limit=runner.model.hard_limit,
            history_samples=len(memory.history),
            estimate=self._estimate(runner),
            prompt_cache=memory.mlx.prompt_cache if runner.pid else None,
            queued=memory.mlx.queued if runner.pid else 0,
            active_requests=memory.mlx.active_requests if runner.pid else 0,
        )
        if current is not None and runner.pid:
            sample.rss, sample.anonymous, sample.pss, sample.uss = (
                current.rss,
                current.anonymous,
                current.pss,
                current.uss,
            )
            sample.process_rss.extend(current.process_rss)
        embedded = self.metrics.embedded.get(runner.name, (0, 0, 0.0))
        return supervisor_pb2.ModelStatus(
            name=runner.name,
            state=STATES[runner.state],
            reason=runner.reason,
            pid=runner.pid,
            restarts=runner.restarts,
            last_used_s_ago=time.monotonic() - runner.last_used,
            memory=sample,
            target=str(runner.model.target),
            draft=str(runner.model.draft or ""),
            in_flight=runner.in_flight,
            generated_tokens=self.metrics.generated.get(runner.name, 0),
            acceptance_rate=self.metrics.last_acceptance.get(runner.name, 0.0),
            embed_requests=embedded[0],
            embedded_inputs=embedded[1],
            embed_seconds=embedded[2],
            loading_s=time.monotonic() - runner.starting_since if runner.starting_since is not None else 0.0,
            last_load_s=runner.last_load_s,
            making_room_for=self.scheduler.making_room_for(runner),
        )

    # -- life cycle -------------------------------------------------------------

    def start(self) -> None:
        self.front.call(self.server.start())
        self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)  # until shutdown
        for http in (self.http, self.ollama_http):
            if http:
                http.start(self.front)
        if self.probes:
            self.probes.start()
        self.memory.start()
        self.scheduler.start()
        log.info(
            "supervisor %d listening on %s (HTTP APIs: OpenAI's, Anthropic's and Ollama's on %s%s; probes on %s), "
            "models: %s",
            os.getpid(),
            self.config.listen,
            self.config.http_listen or "off",
            f", Ollama's clients' address {self.config.ollama_listen}" if self.config.ollama_listen else "",
            self.probes.port if self.probes else "off",
            ", ".join(self.config.models),
        )

    def shutdown(self) -> None:
        """Stop accepting, drain in-flight work, stop every runner, reap them all, remove the sockets."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.shutting_down.set()
        log.info("shutting down")
        self.notifier.stopping()
        self.health.enter_graceful_shutdown()
        # In-flight streams get drain_grace in their runners; one still running after that is cancelled there
        # and ends with UNAVAILABLE "supervisor shutting down", before gRPC's own grace runs out.
        grace = self.config.drain_grace + self.config.kill_timeout + 1
        done = self.front.submit(self.server.stop(grace))
        for http in (self.http, self.ollama_http):
            if http:
                http.begin_stop()
        self.scheduler.stop_all()
        try:
            done.result(grace + 1)
        except concurrent.futures.TimeoutError:
            log.warning("gRPC streams still open after %.0f s", grace + 1)
        for http in (self.http, self.ollama_http):
            if http:
                http.stop()
        self.front.stop()
        self.memory.stop()
        if self.probes:
            self.probes.stop()
        for socket in self.config.runtime_dir.glob("*.sock"):
            socket.unlink(missing_ok=True)
        log.info("stopped")

    def serve_until(self, should_stop) -> None:
        while not should_stop():
            ready, detail = self._readiness()
            self.notifier.tick(ready, detail)
            time.sleep(0.1)
        self.shutdown()
        self.notifier.close()


def prepare_runtime_dir(path) -> None:
    """Owner-only folder for runner sockets; stale sockets from a killed supervisor are removed."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        if path.stat().st_uid != os.getuid():
            raise OSError(f"{path} belongs to another user")
        os.chmod(path, 0o700)
        probe = path / ".write-test"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise OSError(f"runtime_dir {path} is not usable: {error}") from None
    for stale in path.glob("*.sock"):
        stale.unlink(missing_ok=True)
