"""The runner's gRPC service: the decode engine behind proto/runner.proto.

The server starts listening before the models load, with health NOT_SERVING,
so a supervisor can tell "loading" from "dead"; ``attach`` switches it to
SERVING once the engine is ready.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from concurrent import futures

import grpc
import mlx.core as mx
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import __version__
from common.defaults import (
    CHANNEL_OPTIONS,
    COALESCE_FROM,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_PENDING_ROUNDS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_STALL_AFTER,
    DEFAULT_STREAM_INTERVAL,
)
from common.embedding import not_this_kind
from common.errors import NotReady
from common.protocol import runner_pb2, runner_pb2_grpc
from common.reasoning import ReasoningSplitter
from common.requests import FinishReason, fields_of
from common.status import ServiceError, StatusInterceptor
from common.tool_calls import ToolCallStream

from . import platform
from .engine import Engine
from .loading.load import LoadedModel
from .request import GenerationRequest, PreparedRequest
from .results import GenerationStats, Round
from .worker import MlxWorker

log = logging.getLogger("runner")

SERVICE_NAME = runner_pb2.DESCRIPTOR.services_by_name["Runner"].full_name


def request_from_proto(message: runner_pb2.GenerateRequest) -> GenerationRequest:
    return GenerationRequest(**fields_of(message), ignore_eos=message.ignore_eos, request_id=message.request_id)


def stats_to_proto(s: GenerationStats) -> runner_pb2.GenerationStats:
    return runner_pb2.GenerationStats(
        prompt_tokens=s.prompt_tokens,
        generated_tokens=s.generated_tokens,
        rounds=s.rounds,
        drafted=s.drafted,
        accepted=s.accepted,
        forced=s.forced,
        acceptance_rate=s.acceptance_rate,
        tokens_per_round=s.tokens_per_round,
        time_to_first_token_s=s.time_to_first_token,
        prefill_s=s.prefill_seconds,
        decode_s=s.decode_seconds,
        tokens_per_second=s.tokens_per_second,
        releases=s.releases,
        release_positions=s.release_positions,
        active_memory=s.active_memory,
        cache_memory=s.cache_memory,
        peak_memory=s.peak_memory,
        prefill_chunks=s.prefill_chunks,
        cached_tokens=s.cached_tokens,
        drafter=s.drafter,
        depths=s.depths,
    )


class AnswerSplit:
    """A request's answer as its chunks carry it: its reasoning apart from its content (a model that thinks
    before it answers: common.reasoning), and the content split into text and tool calls (common.tool_calls)."""

    def __init__(self, prepared, tokenizer=None):
        fmt = prepared.reasoning
        self.reasoning = ReasoningSplitter(fmt, prepared.thinking) if fmt is not None else None
        self.tools = ToolCallStream(prepared.tool_format) if prepared.tool_format else None
        # The reasoning's tokens: those between the block's markers (counted once the answer is over).
        self._end = (
            [] if fmt is None or tokenizer is None else list(tokenizer.encode(fmt.end, add_special_tokens=False))
        )
        self._ids: list[int] = []
        self.reasoning_tokens = 0

    def feed(self, r: Round) -> tuple[str, str, list]:
        """(reasoning, text, tool-call deltas) of a round; what was held back as well on the last one."""
        reasoning, text, deltas = "", r.text, []
        if self.reasoning is not None:
            self._ids += r.token_ids
            reasoning, text = self.reasoning.feed(r.text)
            if r.finish_reason is not None:
                more_reasoning, more_text = self.reasoning.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
                self.reasoning_tokens = self._count()
        if self.tools is not None:
            text, deltas = self.tools.feed(text)
            if r.finish_reason is not None:
                tail, more = self.tools.finish()
                text, deltas = text + tail, deltas + more
        return reasoning, text, deltas

    def _count(self) -> int:
        """Tokens of the answer's reasoning: up to its end marker, less a start marker the answer wrote itself;
        all of it where the end never came; none where it never reasoned."""
        if not self.reasoning.reasoning_chars and self.reasoning.state not in ("inside", "analysis"):
            return 0
        ids, end = self._ids, self._end
        at = next((i for i in range(len(ids) - len(end) + 1) if end and ids[i : i + len(end)] == end), len(ids))
        opened = self.reasoning.fmt.kind == "think" and not (self.reasoning.fmt.opened and self.reasoning.thinking)
        return max(0, at - (1 if opened and at else 0))


def chunk_to_proto(r: Round, split: AnswerSplit | None = None) -> runner_pb2.GenerateChunk:
    """A round as its chunk; with ``split``, its text split into reasoning, text and tool-call deltas, and a stop
    after complete calls is TOOL_CALLS."""
    reasoning, text, deltas = split.feed(r) if split is not None else ("", r.text, [])
    chunk = runner_pb2.GenerateChunk(
        text=text, reasoning=reasoning, token_ids=r.token_ids, drafted=r.drafted, accepted=r.accepted
    )
    for delta in deltas:
        chunk.tool_calls.add(index=delta.index, id=delta.id, name=delta.name, arguments=delta.arguments)
    for entries, field in ((r.logprobs, chunk.logprobs), (r.prompt_logprobs, chunk.prompt_logprobs)):
        for entry in entries:
            field.add(
                token_id=entry.token,
                token=entry.text,
                logprob=entry.logprob,
                top=[runner_pb2.TopLogprob(token_id=t, token=text, logprob=v) for t, text, v in entry.top],
            )
    tools = split.tools if split is not None else None
    if r.finish_reason is not None:
        chunk.finish_reason = r.finish_reason
        chunk.stop_sequence = r.stop_sequence
        if r.finish_reason == FinishReason.STOP and tools is not None and tools.calls and tools.complete:
            chunk.finish_reason = FinishReason.TOOL_CALLS
    if r.stats is not None:
        chunk.stats.CopyFrom(stats_to_proto(r.stats))
        if split is not None:
            chunk.stats.reasoning_tokens = split.reasoning_tokens
    return chunk


def model_info(loaded: LoadedModel) -> runner_pb2.ModelInfo:
    quantization = loaded.quantization or {}
    return runner_pb2.ModelInfo(
        path=str(loaded.path),
        architecture=str(loaded.config.get("model_type", "")),
        parameters=loaded.parameters,
        context_length=loaded.context_length,
        dtype=loaded.compute_dtype,
        vocab_size=loaded.vocab_size,
        quantization_bits=int(quantization.get("bits", 0)),
        quantization_group_size=int(quantization.get("group_size", 0) if quantization else 0),
        cache=loaded.cache_description(),
        rewindable=loaded.rewindable,
        row_padded_layers=loaded.padded_layers,
        row_padding=loaded.row_padding,
        fusion=loaded.fusion,
        sliding_window=loaded.sliding_window,
        sliding_layers=loaded.sliding_layers,
    )


def prompt_cache_stats(cache) -> runner_pb2.PromptCacheStats:
    return runner_pb2.PromptCacheStats(
        budget=cache.budget,
        bytes=cache.nbytes,
        entries=cache.entries,
        hits=cache.hits,
        misses=cache.misses,
        reused_tokens=cache.reused_tokens,
        evictions=cache.evictions,
        disk_budget=cache.disk.budget if cache.disk else 0,
        disk_bytes=cache.disk.nbytes if cache.disk else 0,
        disk_entries=len(cache.disk.entries) if cache.disk else 0,
        disk_hits=cache.disk_hits,
        disk_failures=cache.disk.failures if cache.disk else 0,
        disk_writes=cache.disk.writes if cache.disk else 0,
        disk_write_s=cache.disk.write_seconds if cache.disk else 0.0,
        disk_read_s=cache.disk.read_seconds if cache.disk else 0.0,
        cold_entries=cache.cold_entries,
        cold_bytes=cache.cold_bytes,
        cold_hits=cache.cold_hits,
    )


def peak_rss() -> int:
    """High-water RSS of this process's own memory.

    On Linux this is ``VmHWM`` from /proc/self/status, not ``ru_maxrss``: a forked child starts with its
    parent's RSS as its high-water mark and execve keeps it, so ``ru_maxrss`` in a runner started by a large
    process reports the parent's size (seen in a bench that forked runners from a 1.4 GiB process).
    Elsewhere ``ru_maxrss`` (bytes on macOS).
    """
    import resource
    import sys

    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class DebugRpcs:
    """DebugBlock and DebugExit, the faults the tests cause (a hung MLX thread, a crash), for a runner service
    with ``debug_rpcs`` and a ``_ready()`` worker that runs ``call``s on its MLX thread: the text runner's and the
    embedding runner's."""

    def _debug(self):
        worker = self._ready()
        if not self.debug_rpcs:
            raise ServiceError(
                grpc.StatusCode.PERMISSION_DENIED, "debug RPCs are off (start the runner with --debug-rpcs)"
            )
        return worker

    def DebugBlock(self, message, context):
        worker = self._debug()
        log.warning("debug: blocking the MLX thread for %.1f s", message.seconds)
        worker.call(lambda: time.sleep(message.seconds))  # not awaited: the caller returns at once
        return runner_pb2.DebugBlockResponse()

    def DebugExit(self, message, context):
        worker = self._debug()
        log.warning("debug: exiting with code %d", message.code)
        worker.call(lambda: os._exit(message.code))  # a fake crash: no cleanup, like a real one
        return runner_pb2.DebugExitResponse()


class RunnerService(DebugRpcs, runner_pb2_grpc.RunnerServicer):
    def __init__(self, name: str, debug_rpcs: bool = False):
        self.name = name
        self.runtime_rss = psutil.Process().memory_info().rss  # before any model is loaded
        self.debug_rpcs = debug_rpcs
        self.engine: Engine | None = None
        self.worker: MlxWorker | None = None
        self.rank_pids: list[int] = []  # a runner group's other ranks (runner.group.Followers)
        self.stream_interval = DEFAULT_STREAM_INTERVAL  # the runner's setting (set by its main)
        self._process = psutil.Process()

    def _hold(self) -> float:
        """How long a stream gathers tokens before it sends them: ``stream_interval`` while ``COALESCE_FROM`` or
        more requests decode (each relayed message costs the supervisor's loop the same, whatever it holds: at
        16 clients, one token a message kept the relay at 0.93-0.96x runner-direct), else 0."""
        worker = self.worker
        return self.stream_interval if worker is not None and worker.active >= COALESCE_FROM else 0.0

    def _ready(self) -> MlxWorker:
        if self.worker is None:
            raise NotReady(f"runner {self.name}: models are still loading")
        return self.worker

    def Generate(self, message, context):
        # Errors are raised, never aborted here: StatusInterceptor gives each its status.
        worker = self._ready()
        request = request_from_proto(message)
        prepared = self.engine.prepare(request)  # checked and tokenized once, before it queues
        if request.n > 1:
            yield from self._choices(worker, request, prepared, context)
            return
        job = worker.submit(prepared)
        context.add_callback(job.cancel)  # client gone or deadline passed
        split = AnswerSplit(prepared, self.engine.tokenizer)
        first = True
        try:
            for round_ in job.results(coalesce=True, hold=self._hold):
                chunk = chunk_to_proto(round_, split)
                if first:
                    chunk.prompt_tokens, first = len(prepared.prompt_ids), False
                    if request.return_prompt_ids:
                        chunk.prompt_ids.extend(
                            prepared.prompt_ids[: len(prepared.prompt_ids) - len(request.resume_ids)]
                        )
                yield chunk
        finally:
            job.cancel()

    def _choices(self, worker: MlxWorker, request: GenerationRequest, first: PreparedRequest, context):
        """n choices of one request: the first is decoded at once; once it is prefilled, a copy of its caches
        goes to the prompt cache (``Engine.share_prefill``) and the others are submitted, each with its own
        seed, so they prefill only the last token and decode as rows of the batch beside it. Their chunks
        interleave, each naming its choice; an error in any ends the call."""
        n = request.n
        seeded = request.seed is not None
        others = [
            self.engine.prepare(dataclasses.replace(request, seed=(request.seed + i) % 2**63 if seeded else None))
            for i in range(1, n)
        ]
        out: queue.Queue = queue.Queue()
        jobs: list = []

        def read(index: int, job) -> None:
            try:
                for round_ in job.results():
                    out.put((index, round_))
                out.put((index, None))
            except BaseException as error:  # noqa: BLE001 - handed to the call
                out.put((index, error))

        def start(index: int, job) -> None:
            jobs.append(job)
            threading.Thread(target=read, args=(index, job), name=f"choice-{index}", daemon=True).start()

        def share(leader) -> None:  # on the MLX thread, once the first choice is prefilled
            self.engine.share_prefill(leader.session)
            for index, prepared in enumerate(others, start=1):
                try:
                    start(index, worker.submit(prepared))
                except Exception as error:  # noqa: BLE001 - a full queue: that choice fails the call
                    out.put((index, error))

        context.add_callback(lambda: [job.cancel() for job in list(jobs)])
        start(0, worker.submit(first, on_prefilled=share))
        splits = {i: AnswerSplit(first, self.engine.tokenizer) for i in range(n)}
        ended, sent_first = 0, False
        try:
            while ended < n:
                index, item = out.get()
                if item is None:
                    ended += 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                chunk = chunk_to_proto(item, splits[index])
                chunk.choice = index
                if not sent_first:
                    chunk.prompt_tokens, sent_first = len(first.prompt_ids), True
                yield chunk
        finally:
            for job in list(jobs):
                job.cancel()

    def Embed(self, message, context):
        self._ready()
        raise not_this_kind(self.name, "generate", "embeddings")

    def Rerank(self, message, context):
        self._ready()
        raise not_this_kind(self.name, "generate", "rerank")

    def CountTokens(self, message, context):
        self._ready()
        prepared = self.engine.prepare(request_from_proto(message), counting=True)
        return runner_pb2.CountTokensResponse(prompt_tokens=len(prepared.prompt_ids))

    def Info(self, message, context):
        self._ready()
        engine = self.engine
        response = runner_pb2.InfoResponse(
            name=self.name,
            target=model_info(engine.target),
            device=platform.device_name(),
            backend=platform.backend(),
            device_detail=platform.describe(),
            device_memory=platform.device_memory(),
            tool_format=engine.tool_format,
            chat_template=bool(getattr(engine.tokenizer, "has_chat_template", False)),
            kv_bits=engine.kv.bits if engine.kv else 0,
            kv_group_size=engine.kv.group_size if engine.kv else 0,
            quantized_kv_start=engine.kv.start if engine.kv else 0,
            ranks=engine.group.size if engine.group else 1,
            rank_pids=self.rank_pids,
            rank_memory=engine.rank_memory,
            parallelism=engine.group.mode if engine.group else "",
            group_backend=engine.settings.backend if engine.group else "",
            num_draft_tokens=engine.default_num_draft_tokens,
            release_interval=engine.settings.release_interval,
            release_enabled=engine.settings.release_enabled,
            cache_limit=engine.cache_limit,
            version=__version__,
            pid=os.getpid(),
            max_queue=self.worker.max_queue,
            max_batch=self.worker.max_batch,
            batch_memory=self.worker.memory.budget or 0,
            speculative=engine.speculative,
            decoding=engine.speculative_note,
            dtype_reason=engine.dtype_reason,
            runtime_rss=self.runtime_rss,
            prompt_cache_budget=engine.prompt_cache.budget,
            drafter=engine.default_drafter,
            adaptive_depth=engine.speculative and engine.settings.num_draft_tokens is None,
            max_draft_tokens=engine.settings.max_draft_tokens,
            max_output_tokens=engine.settings.max_output_tokens,
            reasoning_format=engine.reasoning.kind if engine.reasoning is not None else "",
            vision=engine.vision is not None,
            kind="generate",
        )
        if engine.draft is not None:
            response.draft.CopyFrom(model_info(engine.draft))
        return response

    def Memory(self, message, context):
        # Read straight from MLX's allocator counters: no need to wait for the MLX thread.
        worker = self.worker
        return runner_pb2.MemoryResponse(
            active=mx.get_active_memory(),
            cache=mx.get_cache_memory(),
            peak=mx.get_peak_memory(),
            cache_limit=self.engine.cache_limit if self.engine else 0,
            memory_limit=mx.get_memory_limit(),
            releases=self.engine.total_releases if self.engine else 0,
            rss=self._process.memory_info().rss,
            queued=worker.queued if worker else 0,
            busy=worker.busy if worker else False,
            peak_rss=peak_rss(),
            active_requests=worker.active if worker else 0,
            prompt_cache=prompt_cache_stats(self.engine.prompt_cache) if self.engine else None,
        )

    def ReleaseMemory(self, message, context):
        worker = self._ready()
        released = worker.call(
            lambda: self.engine.release_memory(prompt_cache=message.prompt_cache),
            mirror=("release_memory", {"prompt_cache": message.prompt_cache}),  # every rank's prompt cache
        ).result()
        log.info(
            "released on request: %d prompt-cache entries (%d bytes), %d quantized (%d bytes saved), "
            "then the pool: %d -> %d bytes",
            released.evicted_entries,
            released.evicted_bytes,
            released.cooled_entries,
            released.cooled_bytes,
            released.cache_before,
            released.cache_after,
        )
        return runner_pb2.ReleaseMemoryResponse(
            cache_before=released.cache_before,
            cache_after=released.cache_after,
            evicted_entries=released.evicted_entries,
            evicted_bytes=released.evicted_bytes,
            cooled_entries=released.cooled_entries,
            cooled_bytes=released.cooled_bytes,
        )


class RunnerServer:
    """gRPC server, health and reflection around one RunnerService."""

    def __init__(
        self,
        service: RunnerService,
        address: str,
        max_queue: int = DEFAULT_MAX_QUEUE,
        stall_after: float = DEFAULT_STALL_AFTER,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_pending_rounds: int = DEFAULT_MAX_PENDING_ROUNDS,
    ):
        self.service = service
        self.max_pending_rounds = max_pending_rounds
        self.max_batch = max_batch
        self.stall_after = stall_after
        self._shutting_down = threading.Event()
        self.address = address
        self.max_queue = max_queue
        self.health = health.HealthServicer()
        # Handler threads: one per queued or running stream, plus room for health and memory probes.
        streams = max_queue + max_batch
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=streams + 16, thread_name_prefix="grpc"),
            options=CHANNEL_OPTIONS,
            maximum_concurrent_rpcs=streams + 64,
            interceptors=[StatusInterceptor()],
        )
        runner_pb2_grpc.add_RunnerServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.server.add_insecure_port(address) == 0 and not address.startswith("unix:"):
            raise OSError(f"cannot listen on {address}")

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def start(self) -> None:
        self.server.start()

    def attach(self, engine: Engine, on_fatal) -> None:
        """Models are loaded: start the MLX thread and report SERVING."""
        self.service.engine = engine
        worker = MlxWorker(
            engine,
            self.max_queue,
            on_fatal=on_fatal,
            name=self.service.name,
            max_batch=self.max_batch,
            max_pending_rounds=self.max_pending_rounds,
            group=engine.group,
        )
        worker.start()
        self.service.worker = worker
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        threading.Thread(target=self._watch_mlx_thread, name="stall-watch", daemon=True).start()

    def _watch_mlx_thread(self) -> None:
        """Health says NOT_SERVING while the MLX thread makes no progress (a hung runner)."""
        stalled = False
        while not self._shutting_down.wait(0.25):
            now_stalled = self.service.worker.stalled_for() > self.stall_after
            if now_stalled != stalled:
                stalled = now_stalled
                if stalled:
                    log.error("MLX thread stalled for over %.1f s: health NOT_SERVING", self.stall_after)
                self._set_health(
                    health_pb2.HealthCheckResponse.NOT_SERVING if stalled else health_pb2.HealthCheckResponse.SERVING
                )

    def shutdown(self, grace: float) -> None:
        """NOT_SERVING, no new calls, in-flight work gets ``grace`` seconds, then is cancelled."""
        self._shutting_down.set()
        self.health.enter_graceful_shutdown()
        worker = self.service.worker
        if worker is not None:
            worker.stop(cancel_running=False)
        done = self.server.stop(grace)
        if worker is not None and not worker.join(grace):
            worker.stop(cancel_running=True)
            worker.join(5)
        done.wait(grace + 5)
