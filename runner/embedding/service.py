"""An embedding or reranking runner: the Runner service (proto/runner.proto) over an ``EmbeddingEngine``.

``python -m runner --target FOLDER`` comes here when the folder is an embedding or reranking model
(``common.embedding.model_kind``, or the ``kind`` setting). Embed and Rerank are served; Generate and CountTokens
are refused with INVALID_ARGUMENT naming the model (the supervisor's APIs turn that into a 400 in their shape);
Info, Memory, ReleaseMemory, health and the debug RPCs are as a text runner's, so the supervisor starts, watches,
restarts and unloads it the same way.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import mlx.core as mx
import numpy as np
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import __version__
from common.defaults import CHANNEL_OPTIONS
from common.embedding import not_this_kind
from common.errors import ModelLoadError, NotReady
from common.protocol import runner_pb2, runner_pb2_grpc
from common.status import StatusInterceptor

from .. import platform
from ..server import SERVICE_NAME, DebugRpcs, peak_rss
from .engine import EmbeddingEngine
from .worker import EmbeddingWorker

log = logging.getLogger("runner")


def shorten(vectors: np.ndarray, dimensions: int, normalized: bool) -> np.ndarray:
    """A Matryoshka model's vectors cut to their first ``dimensions`` values, normalised again if they were."""
    if not dimensions or dimensions >= vectors.shape[1]:
        return vectors
    cut = vectors[:, :dimensions]
    if normalized:
        cut = cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)
    return cut


class EmbeddingService(DebugRpcs, runner_pb2_grpc.RunnerServicer):
    def __init__(self, name: str, debug_rpcs: bool = False):
        self.name = name
        self.debug_rpcs = debug_rpcs
        self.runtime_rss = psutil.Process().memory_info().rss
        self.engine: EmbeddingEngine | None = None
        self.worker: EmbeddingWorker | None = None
        self._process = psutil.Process()

    def _ready(self) -> EmbeddingWorker:
        if self.worker is None:
            raise NotReady(f"runner {self.name}: models are still loading")
        return self.worker

    def _wait(self, job, context):
        context.add_callback(job.cancel)  # the caller went away: its rows leave the batches not yet run
        return job.future.result()

    def Embed(self, message, context):
        worker = self._ready()
        engine = self.engine
        if engine.kind != "embed":
            raise not_this_kind(self.name, engine.kind, "embeddings")
        ids = [list(t.ids) for t in message.token_ids]
        rows, truncated = engine.embed_rows(
            list(message.texts), ids, message.truncate, message.dimensions, message.prompt_name
        )
        vectors = shorten(self._wait(worker.submit(rows), context), message.dimensions, engine.sentence.normalize)
        response = runner_pb2.EmbedResponse(prompt_tokens=sum(len(r.ids) for r in rows), truncated=truncated)
        for row, vector in zip(rows, vectors):
            response.embeddings.add(values=vector.tolist(), tokens=len(row.ids))
        return response

    def Rerank(self, message, context):
        worker = self._ready()
        engine = self.engine
        if engine.kind != "rerank":
            raise not_this_kind(self.name, engine.kind, "rerank")
        rows, truncated = engine.rerank_rows(message.query, list(message.documents), message.truncate)
        scores = self._wait(worker.submit(rows), context)
        return runner_pb2.RerankResponse(
            scores=scores.tolist(), prompt_tokens=sum(len(r.ids) for r in rows), truncated=truncated
        )

    def Generate(self, message, context):
        self._ready()
        raise not_this_kind(self.name, self.engine.kind, "chat or completions")

    def CountTokens(self, message, context):
        self._ready()
        raise not_this_kind(self.name, self.engine.kind, "chat or completions")

    def Info(self, message, context):
        worker = self._ready()
        engine = self.engine
        target = runner_pb2.ModelInfo(
            path=str(engine.folder),
            architecture=str(engine.config.get("model_type", "")),
            parameters=engine.parameters,
            context_length=engine.context_length,
            dtype=engine.dtype,
            vocab_size=engine.vocab_size,
            cache="none (an encoder keeps no cache)" if not engine.decoder else "none (no generation)",
        )
        return runner_pb2.InfoResponse(
            name=self.name,
            target=target,
            device=platform.device_name(),
            backend=platform.backend(),
            device_detail=platform.describe(),
            device_memory=platform.device_memory(),
            version=__version__,
            pid=os.getpid(),
            max_queue=worker.max_queue,
            max_batch=worker.max_batch,
            speculative=False,
            decoding=f"{engine.kind}: no decoding",
            runtime_rss=self.runtime_rss,
            ranks=1,
            kind=engine.kind,
            embedding_dimensions=engine.dimensions if engine.kind == "embed" else 0,
            matryoshka_dimensions=engine.matryoshka,
            pooling=engine.sentence.pooling if engine.kind == "embed" else "",
            normalized=engine.sentence.normalize if engine.kind == "embed" else False,
        )

    def Memory(self, message, context):
        worker = self.worker
        return runner_pb2.MemoryResponse(
            active=mx.get_active_memory(),
            cache=mx.get_cache_memory(),
            peak=mx.get_peak_memory(),
            memory_limit=mx.get_memory_limit(),
            rss=self._process.memory_info().rss,
            queued=worker.queued if worker else 0,
            busy=worker.busy if worker else False,
            peak_rss=peak_rss(),
            active_requests=worker.active if worker else 0,
        )

    def ReleaseMemory(self, message, context):
        worker = self._ready()

        def release():
            before = mx.get_cache_memory()
            mx.clear_cache()
            return before, mx.get_cache_memory()

        before, after = worker.call(release).result()
        return runner_pb2.ReleaseMemoryResponse(cache_before=before, cache_after=after)


def serve(args, settings, prepare_unix_socket, exit_bad_start: int, exit_engine_failure: int) -> int:
    """The runner process for an embedding or reranking model (``runner.__main__.main`` hands over here, with its
    socket preparation and exit codes): listen with health NOT_SERVING, load, serve until SIGTERM, drain within
    the grace."""
    import signal

    signalled, failed = [], threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: signalled.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: signalled.append(signum))
    os.umask(0o077)
    service = EmbeddingService(settings.name, settings.debug_rpcs)
    health_service = health.HealthServicer()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=settings.max_queue + 16, thread_name_prefix="grpc"),
        options=CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=settings.max_queue + 64,
        interceptors=[StatusInterceptor()],
    )
    runner_pb2_grpc.add_RunnerServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)

    def set_health(status) -> None:
        for name in ("", SERVICE_NAME):
            health_service.set(name, status)

    set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        if args.listen.startswith("unix:"):
            prepare_unix_socket(args.listen)
        if server.add_insecure_port(args.listen) == 0 and not args.listen.startswith("unix:"):
            raise OSError(f"cannot listen on {args.listen}")
        server.start()
        if args.listen.startswith("unix:"):
            os.chmod(args.listen.removeprefix("unix://"), 0o600)
    except (OSError, RuntimeError) as error:
        print(f"runner: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return exit_bad_start
    started = time.perf_counter()
    try:
        engine = EmbeddingEngine.load(settings.target, settings)
        engine.run(
            engine.embed_rows(["warm up"], [], True, 0, "")[0]
            if engine.kind == "embed"
            else engine.rerank_rows("warm", ["up"], True)[0]
        )
    except ModelLoadError as error:
        print(f"runner: {error}", file=sys.stderr)
        server.stop(0)
        return exit_bad_start
    worker = EmbeddingWorker(engine, settings.max_queue, on_fatal=lambda error: failed.set())
    worker.start()
    service.engine, service.worker = engine, worker
    set_health(health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving %s after %.2f s: %s %s (%s, %d parameters, %s) on %s; %d tokens; %s",
        settings.name,
        time.perf_counter() - started,
        engine.kind,
        engine.config.get("model_type"),
        engine.folder.name,
        engine.parameters,
        engine.dtype,
        platform.describe(),
        engine.context_length,
        f"{engine.dimensions} dimensions, {engine.sentence.pooling} pooling"
        + (", normalised" if engine.sentence.normalize else "")
        if engine.kind == "embed"
        else "scores in [0, 1]",
    )
    while not (signalled or failed.wait(0.1)):
        pass
    log.info("stopping (grace %.1f s)", settings.grace)
    health_service.enter_graceful_shutdown()
    worker.stop(cancel_running=False)
    done = server.stop(settings.grace)
    if not worker.join(settings.grace):
        worker.stop(cancel_running=True)
    done.wait(settings.grace + 5)
    if args.listen.startswith("unix:"):
        Path(args.listen.removeprefix("unix://")).unlink(missing_ok=True)
    log.info("stopped")
    return exit_engine_failure if failed.is_set() else 0
