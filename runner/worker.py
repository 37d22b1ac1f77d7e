"""The MLX thread: every MLX call of the runner happens here, for every request at once.

gRPC handler threads submit ``GenerationJob``s (FIFO; at most ``max_queue``
wait) and control tasks (``call``). The thread keeps up to ``max_batch``
requests active, each a ``Session`` (``runner.session``), and loops:

- control tasks (a pool release, Info), at every turn: never behind a long generation;
- newcomers are admitted while there is room - a place in the batch, and memory
  for their caches next to the others' (``runner.batch_memory``) - and their prompts are prefilled
  one chunk per turn each, between the decode steps of the others; short ones
  that wait at the same time share a forward pass (``runner.prefill.joint_groups``,
  ``runner.batch.prefill_jointly``);
- decoding: a request alone keeps its own decoder - speculative decoding with
  the adaptive depth, or pipelined plain decoding; two or more decode together
  in a ``Batch`` (``runner.batch``), one batched forward pass per step. A
  request joins the batch when its prefill is done and leaves it when it ends
  (or is cancelled, or misses its deadline); when one is left and nobody is
  waiting, it takes its cache back and goes on alone, speculating again.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from common.defaults import DEFAULT_MAX_PENDING_ROUNDS
from common.errors import ClientTooSlow, EngineError, QueueFull, WorkerStopped

from .batch import Batch, prefill_jointly
from .batch_memory import BatchMemory
from .engine import Engine
from .prefill import joint_groups
from .request import PreparedRequest
from .results import Round, merged
from .session import Session

log = logging.getLogger("runner")

# Rounds a request's answer may hold waiting for its client (one to ~17 tokens each, ~1 KB): past it the client
# reads too slowly, and the request ends rather than hold its row and a growing queue (issue #22's back-pressure).
MAX_PENDING_ROUNDS = DEFAULT_MAX_PENDING_ROUNDS
# What rank 0 shares at the top of each turn of a group (runner.group): go on, stop, or nothing to do until
# the doorbell rings (the other ranks then wait off the collectives, where MLX's ring backend polls a core).
TURN_RUN, TURN_STOP, TURN_IDLE = 0, 1, 2


@dataclass
class TurnPlan:
    """What rank 0 decides at the top of a group's turn, reaching the other ranks in one message
    (``Group.share``; small plans take one collective). Indexes are into the active requests as the turn
    begins, the same list on every rank."""

    state: int = TURN_RUN
    mirrors: list = field(default_factory=list)  # controls run on rank 0 that every rank repeats
    admitted: list = field(default_factory=list)  # (request, seed, cancelled while waiting, shares its prefill)
    cancelled: list = field(default_factory=list)  # active requests cancelled by their clients
    slow: list = field(default_factory=list)  # active requests whose clients read too slowly


@dataclass
class GenerationJob:
    request: PreparedRequest
    rounds: queue.Queue = field(default_factory=queue.Queue)  # Round, an exception, or None at the end
    cancelled: threading.Event = field(default_factory=threading.Event)
    session: Session | None = None  # once admitted
    on_prefilled: Callable[[GenerationJob], None] | None = None  # called once, on the MLX thread, after its prefill
    cancelled_before: bool = False  # in a runner group: cancelled before admission, as rank 0 shared it
    kept_prefill: bool = False  # its prefilled caches went to the prompt cache (Engine.keep_prefill)

    def cancel(self) -> None:
        self.cancelled.set()

    def results(self, coalesce: bool = False, hold=None):
        """Rounds as the MLX thread produces them; re-raises its error. ``coalesce``: the rounds already waiting
        when one is taken go with it as one (``runner.results.merged``), so a reader that falls behind - a
        stream whose client, or the supervisor relaying it, is slower than the batch - sends fewer, larger
        messages instead of a backlog of small ones. ``hold()``: seconds to gather more rounds after the first
        (0: only those waiting already); the last round is never held."""
        waiting = _NOTHING
        while True:
            item, waiting = (self.rounds.get() if waiting is _NOTHING else waiting), _NOTHING
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            until = time.monotonic() + (hold() if coalesce and hold is not None else 0.0)
            while coalesce and item.finish_reason is None:
                left = until - time.monotonic()
                try:
                    more = self.rounds.get(timeout=left) if left > 0 else self.rounds.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, Round):  # the end, or an error: after this round
                    waiting = more
                    break
                item = merged(item, more)
            yield item


_NOTHING = object()


class _Discard:
    """A follower rank's answer queue: rank 0 answers the client; the others' rounds go nowhere."""

    def put(self, item) -> None:
        pass

    def qsize(self) -> int:
        return 0


class MlxWorker:
    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        on_fatal=None,
        name: str = "runner",
        max_batch: int = 1,
        max_pending_rounds: int = MAX_PENDING_ROUNDS,
        group=None,
    ):
        self.engine = engine
        # A runner group (runner.group): every rank runs this loop; what only rank 0 knows (arrivals,
        # cancellations, slow clients, controls) reaches the others in one plan at the top of each turn
        # (TurnPlan), so every rank takes the same turns with the same requests. Ranks 1..N-1 serve nobody:
        # their answers are discarded.
        self.group = group
        self.follower = group is not None and not group.leader
        self._plan = TurnPlan()  # a group's plan of the turn under way (rank 0's, on every rank)
        self.max_queue = max_queue
        self.max_batch = max(1, max_batch)
        self.max_pending_rounds = max_pending_rounds
        self.name = name
        self._on_fatal = on_fatal or (lambda error: None)
        self._lock = threading.Condition()
        self._jobs: collections.deque[GenerationJob] = collections.deque()  # waiting, not yet admitted
        self._controls: collections.deque[tuple[callable, Future, tuple | None]] = collections.deque()
        self._active: list[GenerationJob] = []  # admitted: prefilling or decoding
        self._batch = Batch(engine.target.model, engine.release_memory, engine.settings.release_enabled, kv=engine.kv)
        self._batch.model = engine.batch_model(self._batch)  # each row with its request's LoRA adapter
        self._planner = engine.prefill_planner()  # its limits size the prefill passes requests share
        self.memory = BatchMemory(engine.cache_cost, engine.settings.batch_memory)
        self._stopping = False
        self.heartbeat = time.monotonic()  # last sign of life of the MLX thread
        self._thread = threading.Thread(target=self._run, name="mlx", daemon=True)
        self.batched_steps = 0
        self.joint_prefills = 0  # prefill passes requests shared

    def start(self) -> None:
        self._thread.start()

    # -- called from gRPC threads --------------------------------------------

    def submit(self, request: PreparedRequest, on_prefilled=None) -> GenerationJob:
        """Queue ``request``; ``on_prefilled(job)`` runs on the MLX thread once its prompt is in."""
        job = GenerationJob(request, on_prefilled=on_prefilled)
        with self._lock:
            if self._stopping:
                raise WorkerStopped(f"runner {self.name}: shutting down")
            room = self.max_batch - len(self._active)  # an active slot is taken at the next turn
            if len(self._jobs) - max(0, room) >= self.max_queue:
                raise QueueFull(f"runner {self.name}: {self.max_queue} requests already waiting")
            self._jobs.append(job)
            self._lock.notify()
        return job

    def call(self, fn, mirror: tuple[str, dict] | None = None) -> Future:
        """Run ``fn()`` on the MLX thread at the next safe point. ``mirror``: in a runner group, the engine
        method and arguments every other rank runs at the same point (a control that changes what the ranks
        must agree on, such as emptying the prompt cache)."""
        future: Future = Future()
        with self._lock:
            if self._stopping and not self._thread.is_alive():
                raise WorkerStopped(f"runner {self.name}: shutting down")
            self._controls.append((fn, future, mirror))
            self._lock.notify()
        return future

    @property
    def queued(self) -> int:
        return len(self._jobs)

    @property
    def busy(self) -> bool:
        return bool(self._active)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def departures(self) -> int:
        """Times rows left the batch, each time one copy of the batched cache (rows that end at one step leave
        together)."""
        return self._batch.departures

    def stop(self, cancel_running: bool) -> None:
        """Take no new work; cancel the waiting jobs (and the running ones if asked)."""
        with self._lock:
            self._stopping = True
            waiting = list(self._jobs)
            self._jobs.clear()
            running = list(self._active)
            self._lock.notify()
        for job in waiting:
            job.rounds.put(WorkerStopped(f"runner {self.name}: shutting down"))
            job.rounds.put(None)
        if cancel_running:
            for job in running:
                job.cancel()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds since the MLX thread last showed progress (0 while it does)."""
        return time.monotonic() - self.heartbeat

    # -- the MLX thread --------------------------------------------------------

    def _shared(self, value):
        """``value`` as rank 0 has it (alone: as it is)."""
        return value if self.group is None else self.group.share(value)

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - outside a turn: a group's collective (a rank is gone), a control
            log.error("engine failure: %s: %s", type(error).__name__, error)
            for job in list(self._active):
                self._fail(job, error)
            self._on_fatal(error)

    def _loop(self) -> None:
        while True:
            if self.group is not None:
                admitted = self._group_turn()
                if admitted is None:
                    return
            else:
                with self._lock:
                    while not (self._jobs or self._controls or self._stopping or self._active):
                        self.heartbeat = time.monotonic()
                        self._lock.wait(0.5)
                    self.heartbeat = time.monotonic()
                    if self._stopping and not (self._jobs or self._controls or self._active):
                        return
                self._run_controls()  # before admitting: the jobs queued while a control ran start at this turn too
                admitted = []
                with self._lock:
                    while self._room_for_next(admitted):
                        admitted.append(self._jobs.popleft())
            try:
                for job in admitted:
                    self._admit(job)
                self._turn()
            except BaseException as error:  # noqa: BLE001 - MLX state can no longer be trusted
                log.error("engine failure: %s: %s", type(error).__name__, error)
                for job in list(self._active):
                    self._fail(job, error)
                self._on_fatal(error)
                return

    def _group_turn(self) -> list[GenerationJob] | None:
        """The top of a group's turn: rank 0 decides (``TurnPlan``) and shares it; every rank applies it.
        Returns the jobs admitted (a follower makes its own), or None when the group stops."""
        if self.follower:
            while True:
                plan = self.group.share()
                if plan.state != TURN_IDLE:
                    break
                self.group.doorbell.wait()  # rank 0 has nothing to do until it rings (no collective: no CPU)
            self._plan = plan
            if plan.state == TURN_STOP:
                return None
            self._apply_mirrors(plan.mirrors)
            jobs = []
            for request, seed, cancelled, shares in plan.admitted:
                prepared = dataclasses.replace(self.engine.prepare(request), seed=seed)
                hook = (lambda job: self.engine.share_prefill(job.session)) if shares else None
                jobs.append(GenerationJob(prepared, rounds=_Discard(), on_prefilled=hook, cancelled_before=cancelled))
            return jobs
        with self._lock:
            idle = not (self._jobs or self._controls or self._stopping or self._active)
        if idle:  # the others wait on the doorbell, not in a collective
            self.group.share(TurnPlan(TURN_IDLE))
        with self._lock:
            while not (self._jobs or self._controls or self._stopping or self._active):
                self.heartbeat = time.monotonic()
                self._lock.wait(0.5)
                self.group.doorbell.check()  # a rank that died while idle ends the group now, not at a request
            self.heartbeat = time.monotonic()
            stop = self._stopping and not (self._jobs or self._controls or self._active)
        if idle:
            self.group.doorbell.ring()
        if stop:
            self.group.share(TurnPlan(TURN_STOP))
            return None
        mirrors = self._run_controls(shared=False)  # they travel in the plan
        admitted = []
        with self._lock:
            while self._room_for_next(admitted):
                admitted.append(self._jobs.popleft())
        cancelled = [i for i, job in enumerate(self._active) if job.cancelled.is_set()]
        slow = [i for i, job in enumerate(self._active) if i not in cancelled and self._too_slow(job)]
        self._plan = plan = TurnPlan(
            TURN_RUN,
            mirrors,
            [(j.request.request, j.request.seed, j.cancelled.is_set(), j.on_prefilled is not None) for j in admitted],
            cancelled,
            slow,
        )
        self.group.share(plan)
        for job, (_, _, cancelled_before, _) in zip(admitted, plan.admitted):
            job.cancelled_before = cancelled_before  # as shared: a cancel since then counts at the next turn
        return admitted

    def _room_for_next(self, admitted: list | None = None) -> bool:
        """Whether the next waiting job may start now: a place in the batch, and room for its cache next to
        the active ones' (``runner.batch_memory``). Under the lock."""
        if not self._jobs:
            return False
        active = self._active + (admitted or [])
        return len(active) < self.max_batch and self.memory.admits([j.request for j in active], self._jobs[0].request)

    def _run_controls(self, shared: bool = True) -> list:
        """Run the queued control tasks (rank 0's, in a group); returns the mirrors every rank repeats. In a
        group, ``shared``: share them now (mid-turn, between prefill chunks); else the caller's plan carries them."""
        mirrors = []
        while not self.follower:
            with self._lock:
                if not self._controls:
                    break
                fn, future, mirror = self._controls.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                    self.heartbeat = time.monotonic()
                except BaseException as error:  # noqa: BLE001 - handed to the caller
                    future.set_exception(error)
            if mirror is not None:
                mirrors.append(mirror)
        if self.group is not None and shared:
            mirrors = self._shared(mirrors) or []
            if self.follower:
                self._apply_mirrors(mirrors)
        return mirrors

    def _apply_mirrors(self, mirrors: list) -> None:
        for name, kwargs in mirrors:
            getattr(self.engine, name)(**kwargs)

    def _admit(self, job: GenerationJob) -> None:
        if job.cancelled_before if self.group is not None else job.cancelled.is_set():
            job.rounds.put(None)
            return
        log.info("request %s: start", job.request.request_id or "-")
        try:
            job.session = self.engine.session(job.request)
        except EngineError as error:
            job.rounds.put(error)
            job.rounds.put(None)
            return
        with self._lock:
            self._active.append(job)

    def _turn(self) -> None:
        """One unit of work for every active request: a prefill chunk, or a decode step."""
        cancelled = [j for j in self._active if j.cancelled.is_set()]
        slow = []
        if self.group is not None:  # rank 0's view as the turn began (its plan), on every rank
            cancelled = [self._active[i] for i in self._plan.cancelled]
            for job in cancelled:
                job.cancelled.set()
            slow = [self._active[i] for i in self._plan.slow]
            for job in slow:
                self._too_slow_error(job)
        for job in cancelled + slow:
            job.session.cancel()
        if cancelled or slow:
            self._end([(job, None) for job in cancelled + slow])
        self._prefill([j for j in self._active if not j.session.prefilled])
        decoding = [j for j in self._active if j.session.prefilled and not j.session.done]
        if not decoding:
            return
        # Company is coming when someone is prefilling, or waiting with room to be admitted.
        waiting = False  # in a group, a request that arrives now joins at the next turn's plan
        if self.group is None:
            with self._lock:
                waiting = self._room_for_next()
        waiting = waiting or any(not j.session.prefilled for j in self._active)
        if len(decoding) == 1 and not waiting:
            self._solo(decoding[0])
        else:
            self._batched(decoding)
        self.heartbeat = time.monotonic()

    def _prefill(self, prefilling: list[GenerationJob]) -> None:
        """A prefill chunk for each request still prefilling; short prompts that wait together share a pass
        (``runner.prefill.joint_groups``)."""
        needs = [(job, job.session.joint_prefill()) for job in prefilling]
        joint = [(job, need) for job, need in needs if need is not None]
        groups = joint_groups([need for _, need in joint], self._planner) if len(joint) > 1 else []
        if self.group is not None and len(joint) > 1:  # sized from measured times: rank 0's grouping
            groups = self._shared(groups) or []
        shared = [[joint[i][0] for i in group] for group in groups if len(group) > 1]
        together = {id(job) for group in shared for job in group}
        for group in shared + [[job] for job in prefilling if id(job) not in together]:
            try:
                if len(group) > 1:
                    prefill_jointly([job.session for job in group])
                    self.joint_prefills += 1
                else:
                    group[0].session.prefill_chunk()
            except EngineError as error:
                for job in group:
                    self._fail(job, error)
            for job in group:
                if job.on_prefilled is not None and job.session.prefilled:
                    hook, job.on_prefilled = job.on_prefilled, None
                    hook(job)
                if not job.kept_prefill and job.session.prefilled and self.engine.keeps_prefills(job.session):
                    job.kept_prefill = True
                    self.engine.keep_prefill(job.session)
            self.heartbeat = time.monotonic()
            self._run_controls()

    def _solo(self, job: GenerationJob) -> None:
        session = job.session
        if session.in_batch:  # the last of a batch: its own cache back, speculating again
            self._deliver_rows(self._batch.settle())  # its token the batch has queued
            if session.done:
                return
            self._batch.leave([session], give_back=[True])
        round_ = session.solo_round()
        self._deliver(job, round_)

    def _batched(self, decoding: list[GenerationJob]) -> None:
        newcomers = [j for j in decoding if not j.session.in_batch]
        for job in newcomers:  # a token its pipelined decoder has queued comes out before it joins
            round_ = job.session.settle()
            if round_ is not None:
                self._deliver(job, round_)
        newcomers = [j for j in newcomers if not j.session.done]
        if newcomers:
            self._deliver_rows(self._batch.settle())  # the queued step has no row for them
            self._batch.join([j.session for j in newcomers])
        if len(self._batch):
            self._deliver_rows(self._batch.step())
            self.batched_steps += 1

    def _deliver_rows(self, rounds: list) -> None:
        """A batched step's (session, Round) pairs, each to its job."""
        jobs = {id(j.session): j for j in self._active}
        self._deliver_all([(jobs[id(session)], round_) for session, round_ in rounds])

    def _deliver(self, job: GenerationJob, round_: Round) -> None:
        self._deliver_all([(job, round_)])

    def _deliver_all(self, delivered: list[tuple[GenerationJob, Round]]) -> None:
        """Each round to its job; the requests that ended with theirs end together (``_end``). A request whose
        client has let ``max_pending_rounds`` rounds wait ends with ClientTooSlow: its row goes to others, and
        what it holds stays bounded (the rounds already there are still read first)."""
        ended = [(job, round_) for job, round_ in delivered if job.session.done]
        for job, round_ in delivered:
            if not job.session.done:
                job.rounds.put(round_)
        if self.group is None:  # in a group, rank 0's next plan says (the same on every rank)
            for job, _ in delivered:
                if not job.session.done and self._too_slow(job):
                    self._too_slow_error(job)
                    job.session.cancel()
                    ended.append((job, None))
        if ended:
            self._end(ended)

    def _too_slow(self, job: GenerationJob) -> bool:
        return job.rounds.qsize() > self.max_pending_rounds

    def _too_slow_error(self, job: GenerationJob) -> None:
        job.session.error = ClientTooSlow(
            f"the client reads too slowly: {self.max_pending_rounds} rounds were waiting for it, so "
            f"the generation was stopped after {job.session.stats.generated_tokens} tokens"
        )

    def _end(self, ended: list[tuple[GenerationJob, Round | None]]) -> None:
        """Finish requests: (job, its last round or None). Those in the batch leave it in one go - one copy of
        the batched cache for all of them, not one each (a burst of equal requests ends at the same step)."""
        leaving = [job.session for job, _ in ended if job.session.in_batch]
        if leaving:
            self._batch.leave(leaving, give_back=[s.keeps_cache for s in leaving])
        for job, last in ended:
            final = job.session.final_round(last)
            job.rounds.put(job.session.error or final)  # a request whose grammar failed ends with the error
            job.rounds.put(None)
            with self._lock:
                self._active.remove(job)
            s = final.stats
            log.info(
                "request %s: %s after %d tokens, %d rounds, acceptance %.2f, %.0f tok/s, releases %s; prompt %d "
                "tokens (%d from the prompt cache), prefilled in %.2f s",
                job.request.request_id or "-",
                final.finish_reason.name.lower(),
                s.generated_tokens,
                s.rounds,
                s.acceptance_rate,
                s.tokens_per_second,
                s.release_positions,
                s.prompt_tokens,
                s.cached_tokens,
                s.prefill_seconds,
            )

    def _fail(self, job: GenerationJob, error: BaseException) -> None:
        session = job.session
        if session is not None:
            if session.in_batch:
                try:
                    self._batch.leave([session], give_back=[False])
                except Exception:  # noqa: BLE001 - the batch goes with the runner
                    pass
            session.abandon()
        job.rounds.put(error)
        job.rounds.put(None)
        with self._lock:
            if job in self._active:
                self._active.remove(job)
