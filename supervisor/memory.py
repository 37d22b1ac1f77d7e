"""The memory policy: watch every runner with psutil and act on its limits.

Per model, on every sample (default once a second):
- measured = anonymous memory of the runner's process tree (rss - shared), so
  memory-mapped weight files are not mistaken for growth;
- over ``hard_limit``: drain and restart the runner; its in-flight request
  fails with RESOURCE_EXHAUSTED naming the limit and the measured value;
- over ``soft_limit``: ask the runner to release MLX's pool (ReleaseMemory),
  at most once per ``SOFT_RELEASE_EVERY`` seconds, logging before and after.
  The prompt cache goes first: with a cold tier its float entries are
  quantized, and only a later release, if still over, empties it (a disk tier
  keeps what was written either way).
  Memory that is still in use after a release is left alone until it reaches
  the hard limit, so a runner that needs its memory is not restarted in a loop.

On an NVIDIA GPU (MLX's CUDA build) the model's buffers live in the GPU's own
memory, which RSS does not count: there ``measured`` adds what MLX holds on the
device (active + pool, from the runner's Memory RPC), and the memory that
admission and the default budgets compare against is the GPU's free memory
(``nvidia-smi``). On Apple silicon the memory is shared and RSS-based
accounting stays as it is.

Before a runner starts, ``admit`` checks the available memory
against what the model will need (``common.footprint``: the weights as they
will sit in memory, the KV caches of the whole context, the prefill's transient
and the runtime), and refuses instead of risking the OOM killer.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass

import grpc
import psutil

from common.footprint import (
    Estimate,
    FootprintError,
    ModelFootprint,
    default_prompt_cache_bytes,
    estimate,
    expected_backend,
    expected_device,
    resolve_dtype,
)
from common.protocol import runner_pb2

from .config import ModelConfig
from .runners import ManagedRunner, State

log = logging.getLogger("supervisor")

HISTORY = 120
FULL_INFO_EVERY = 10  # PSS/USS walk /proc/PID/smaps: costly, so less often
SOFT_RELEASE_EVERY = 5.0


@dataclass
class Sample:
    at: float
    rss: int
    anonymous: int
    pss: int = 0
    uss: int = 0
    process_rss: tuple[int, ...] = ()  # each process of the tree: the runner, then a group's other ranks


@dataclass
class MlxFigures:
    active: int = 0
    cache: int = 0
    peak: int = 0
    releases: int = 0
    peak_rss: int = 0  # the runner's own high-water RSS
    prompt_cache: object = None  # runner_pb2.PromptCacheStats
    queued: int = 0  # requests waiting in the runner
    active_requests: int = 0  # requests it prefills or decodes


class RunnerMemory:
    """History and the latest figures of one runner."""

    def __init__(self):
        self.history: collections.deque[Sample] = collections.deque(maxlen=HISTORY)
        self.peak_rss = 0
        self.mlx = MlxFigures()
        self.last_soft_release = 0.0
        self.soft_releases = 0
        self.evicted_entries = 0  # prompt-cache entries the soft limit emptied
        self.hard_restarts = 0
        self._full = Sample(0, 0, 0)

    @property
    def current(self) -> Sample | None:
        return self.history[-1] if self.history else None

    @property
    def growth_rate(self) -> float:
        if len(self.history) < 2:
            return 0.0
        first, last = self.history[0], self.history[-1]
        return (last.anonymous - first.anonymous) / max(last.at - first.at, 1e-9)


def sample_tree(pid: int, count: int, previous: Sample) -> Sample:
    root = psutil.Process(pid)
    rss = anonymous = pss = uss = 0
    each = []
    full = count % FULL_INFO_EVERY == 0
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_info()
            each.append(info.rss)
            rss += info.rss
            anonymous += info.rss - getattr(info, "shared", 0)
            if full:
                detail = process.memory_full_info()
                pss += getattr(detail, "pss", 0)
                uss += getattr(detail, "uss", 0)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    if not full:
        pss, uss = previous.pss, previous.uss
    return Sample(time.monotonic(), rss, anonymous, pss, uss, tuple(each))


class AdmissionRefused(Exception):
    pass


class Estimates:
    """Per model: what its runner will need at most, from its folders (read once) and the measured runtime."""

    def __init__(self):
        self._footprints: dict[str, list[ModelFootprint]] = {}
        self.runtime_overhead: int | None = None  # measured by the last runner that started (Info.runtime_rss)

    def footprints(self, model: ModelConfig) -> list[ModelFootprint]:
        """The target's and the draft's footprints (and a drafter head's): from their folders, or for a hub
        reference not resolved yet (``estimate`` before a pull), from the hub cache or the hub itself
        (supervisor.hub.footprint)."""
        if model.name not in self._footprints:
            found = []
            for key in ("target", "draft"):
                if key in model.refs:
                    from . import hub

                    found.append(hub.footprint(model.refs[key]))
                elif getattr(model, key) is not None:
                    found.append(ModelFootprint.of(getattr(model, key)))
            if model.runner.head is not None:  # a drafter head (runner.drafting.head): its layer's weights and cache
                found.append(ModelFootprint.of(model.runner.head))
            if model.runner.block is not None:  # a block drafter (runner.drafting.block): its weights and context cache
                found.append(ModelFootprint.of(model.runner.block))
            self._footprints[model.name] = found
        return self._footprints[model.name]

    def of(self, model: ModelConfig, available: int | None = None) -> tuple[Estimate, str]:
        """The estimate and the dtype it assumes ("checkpoint" or "float32")."""
        footprints = self.footprints(model)
        available = free_memory(available)
        device = expected_device()
        context = model.runner.max_context or None
        dtype, _ = resolve_dtype(model.runner.dtype, device, footprints, available, context=context)
        needed = estimate(
            footprints,
            dtype,
            device,
            context=context,
            runtime_overhead=self.runtime_overhead,
            kv_bits=model.runner.kv_bits,
            kv_group_size=model.runner.kv_group_size,
            ranks=model.runner.ranks,
            here=1 if model.runner.hostfile else None,  # across hosts, rank 0's share; the others are theirs
            images=model.runner.max_images,
            image_pixels=model.runner.image_pixels,
            max_chunk=model.runner.prefill_chunk_on(device),
        )
        return needed, dtype

    def measured_runtime(self, rss: int) -> None:
        if rss > 0:
            self.runtime_overhead = rss + SERVING_OVERHEAD


def limit_room(model: ModelConfig, needed: Estimate) -> int | None:
    """The room a model's memory limit leaves above its estimate (up to the soft limit, else half the way to
    the hard limit); None when it has no limit."""
    if not (model.soft_limit or model.hard_limit):
        return None
    return (model.soft_limit or needed.total + (model.hard_limit - needed.total) // 2) - needed.total


def free_memory(available: int | None = None) -> int:
    """``available``, or what the runners' device has available now: the GPU's free memory where MLX runs on
    CUDA (and nvidia-smi answers), else the machine's available memory."""
    if available is not None:
        return available
    if expected_backend() == "cuda":
        free = cuda_free_memory()
        if free is not None:
            return free
    return psutil.virtual_memory().available


def cuda_free_memory() -> int | None:
    """Free bytes of the first visible NVIDIA GPU, from nvidia-smi; None when it does not answer."""
    visible = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--id={visible}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return int(done.stdout.strip().splitlines()[0]) * 2**20 if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def measured_memory(sample: Sample, mlx: MlxFigures, backend: str) -> int:
    """What the limits compare: the runner tree's anonymous memory, plus on CUDA what MLX holds on the GPU
    (active + pool), which RSS does not see."""
    return sample.anonymous + (mlx.active + mlx.cache if backend == "cuda" else 0)


def prompt_cache_budget(model: ModelConfig, needed: Estimate | None, available: int | None = None) -> int:
    """The prompt cache's byte budget for a model.

    Set in the config: that. Otherwise an eighth of the machine's memory, at most 4 GiB
    (``common.footprint.default_prompt_cache_bytes``) - and no more than the room above the
    model's estimate: up to its memory limit when it has one (the soft limit if set, else half
    the way to the hard limit), so a full cache alone never pushes the runner over it; else
    what the machine has available at load, half of it, so the cache of a model admitted into
    little room does not take what the model itself will need.
    """
    if model.runner.prompt_cache is not None:
        return model.runner.prompt_cache
    budget = default_prompt_cache_bytes()
    if needed is None:
        return budget
    room = limit_room(model, needed)
    if room is None:
        room = (free_memory(available) - needed.total) // 2
    return max(0, min(budget, room))


def batch_memory_budget(
    model: ModelConfig, needed: Estimate | None, prompt_cache: int, available: int | None = None
) -> int | None:
    """Bytes the runner's batched requests' caches may take, projected to their ends (``runner.batch_memory``).

    Set in the config: that. Otherwise the KV cache the estimate already counts (one request over the whole
    context) plus the room above the estimate: up to the model's soft limit (else half the way to its hard
    limit) when it has one - the prompt cache is emptied first there, so it does not count - or else what
    the machine has available at load, less the prompt cache's budget. None (no estimate): no limit.
    """
    if model.runner.batch_memory is not None:
        return model.runner.batch_memory
    if needed is None:
        return None
    room = limit_room(model, needed)
    if room is None:
        room = free_memory(available) - needed.total - prompt_cache
    return needed.kv_cache + max(0, room)


SERVING_OVERHEAD = 60 * 2**20  # gRPC's threads, the tokenizer and first allocations, on top of the bare runtime


def admit(model: ModelConfig, estimates: Estimates, available: int | None = None) -> Estimate | None:
    """Refuse a model that will not fit in ``available`` (default: what the machine has now); one whose folder
    cannot be read is left to its runner to report."""
    available = free_memory(available)
    try:
        needed, dtype = estimates.of(model, available)
    except (OSError, FootprintError) as error:
        log.warning("model %s: no memory estimate (%s); its runner will say what is wrong", model.name, error)
        return None
    if needed.total > available:
        raise AdmissionRefused(
            f"model {model.name}: needs about {needed.total / 2**20:.0f} MiB ({dtype} weights "
            f"{needed.weights / 2**20:.0f} MiB, KV cache {needed.kv_cache / 2**20:.0f} MiB), only "
            f"{available / 2**20:.0f} MiB available"
        )
    return needed


class MemoryWatch:
    def __init__(self, runners: dict[str, ManagedRunner], period: float, on_sample=lambda name, memory: None):
        self.runners = runners
        self.period = period
        self.memory = {name: RunnerMemory() for name in runners}
        self._on_sample = on_sample
        self._stop = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self.backend = expected_backend()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._count += 1
            for name, runner in list(self.runners.items()):  # a model named by a request may be added
                try:
                    self.check(runner)
                except Exception as error:  # noqa: BLE001 - one bad sample must not stop the watch
                    log.debug("model %s: memory sample failed: %s", name, error)

    def check(self, runner: ManagedRunner) -> None:
        memory = self.memory.setdefault(runner.name, RunnerMemory())
        pid = runner.pid
        if not pid or runner.state not in (State.STARTING, State.SERVING):
            return
        sample = sample_tree(pid, self._count, memory.current or Sample(0, 0, 0))
        memory.history.append(sample)
        memory.peak_rss = max(memory.peak_rss, sample.rss)
        if runner.state == State.SERVING and runner.client is not None:
            try:
                m = runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=0.5)
                memory.mlx = MlxFigures(
                    m.active, m.cache, m.peak, m.releases, m.peak_rss, m.prompt_cache, m.queued, m.active_requests
                )
                memory.peak_rss = max(memory.peak_rss, m.peak_rss)
            except grpc.RpcError:
                pass
            self._apply_limits(runner, memory, sample)
        self._on_sample(runner.name, memory)

    def _apply_limits(self, runner: ManagedRunner, memory: RunnerMemory, sample: Sample) -> None:
        model = runner.model
        measured = measured_memory(sample, memory.mlx, self.backend)
        if model.hard_limit and measured > model.hard_limit:
            message = (
                f"model {runner.name}: runner memory {measured / 2**20:.0f} MiB is over the hard limit "
                f"of {model.hard_limit / 2**20:.0f} MiB; the runner is restarting"
            )
            log.warning(message)
            memory.hard_restarts += 1
            memory.history.clear()
            runner.restart("hard memory limit", grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            return
        now = time.monotonic()
        if model.soft_limit and measured > model.soft_limit and now - memory.last_soft_release >= SOFT_RELEASE_EVERY:
            memory.last_soft_release = now
            try:
                # The prompt cache goes first: its buffers then leave with the pool.
                released = runner.client.stub.ReleaseMemory(
                    runner_pb2.ReleaseMemoryRequest(prompt_cache=True), timeout=5
                )
            except grpc.RpcError as error:
                log.warning("model %s: ReleaseMemory failed: %s", runner.name, error.details())
                return
            memory.soft_releases += 1
            memory.evicted_entries += released.evicted_entries
            # On CUDA the pool is what the release returned to the device: released.cache_after.
            left = MlxFigures(active=memory.mlx.active, cache=released.cache_after)
            after = measured_memory(sample_tree(runner.pid, 1, sample), left, self.backend) if runner.pid else 0
            log.info(
                "model %s: over the soft limit (%.0f MiB > %.0f MiB): evicted %d prompt-cache entries "
                "(%.1f MiB), quantized %d (%.1f MiB saved), then released the pool (%d -> %d bytes); "
                "memory now %.0f MiB",
                runner.name,
                measured / 2**20,
                model.soft_limit / 2**20,
                released.evicted_entries,
                released.evicted_bytes / 2**20,
                released.cooled_entries,
                released.cooled_bytes / 2**20,
                released.cache_before,
                released.cache_after,
                after / 2**20,
            )


SUPERVISOR_ALLOWANCE = 256 * 2**20  # the supervisor's own RSS (74-120 MiB measured) with headroom


def pod_memory(config) -> tuple[int, list[tuple[str, Estimate, str]]]:
    """Memory a host (a pod, a unit's MemoryMax) needs to serve ``config``: the estimates of the models that
    can be loaded at once (all of them, or the ``max_loaded`` largest) and the supervisor's allowance.
    Returns the total and, per model, its estimate and dtype. Reads the model folders; starts nothing."""
    estimates = Estimates()
    rows = [(name, *estimates.of(model)) for name, model in config.models.items()]
    largest = sorted((needed.total for _, needed, _ in rows), reverse=True)
    loaded = largest[: config.max_loaded] if config.max_loaded else largest
    return sum(loaded) + SUPERVISOR_ALLOWANCE, rows
