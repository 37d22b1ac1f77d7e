"""Batching: requests decoded together on the MLX thread (runner.worker, runner.batch), in-process.

Measured on the default pair, greedy: every batched request's tokens equal the
same request decoded alone, whatever joins or leaves around it (the batched
product sums in the same order on this CPU). The tests hold that; README says
what could differ elsewhere.
"""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.requests import FinishReason
from common.settings import CACHE_LIMIT_UNBOUNDED, RunnerSettings
from runner.engine import Engine
from runner.prefill import PrefillPlanner, joint_groups
from runner.request import GenerationRequest
from runner.worker import MlxWorker
from tests.helpers import collect, most_active

PROMPTS = (
    "The for statement is used to iterate over the elements of a sequence",
    "A class definition defines a class object",
    "Assignment statements are used to (re-)bind names to values",
    "The import statement",
    "Exceptions can be raised with the raise statement",
    "The while statement is used for repeated execution",
)


@pytest.fixture(scope="module")
def batch_engine():
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))


@pytest.fixture(scope="module")
def worker(batch_engine):
    worker = MlxWorker(batch_engine, max_queue=64, max_batch=4)
    worker.start()
    yield worker
    worker.stop(cancel_running=True)
    worker.join(10)


def alone(engine, **fields):
    fields = {"ignore_eos": True, "cache_prompt": False, **fields}
    tokens, text, last = collect(engine.generate(GenerationRequest(**fields)))
    return tokens, text, last


def submit(worker, engine, **fields):
    return worker.submit(engine.prepare(GenerationRequest(**{"ignore_eos": True, "cache_prompt": False, **fields})))


def results(job):
    tokens, text, last = [], "", None
    for last in job.results():
        tokens += last.token_ids
        text += last.text
    return tokens, text, last


def test_batched_greedy_requests_equal_each_one_alone(worker, batch_engine):
    lengths = (200, 60, 150, 90, 120, 40)  # they leave at different steps; the last two wait for room (max_batch 4)
    expected = [alone(batch_engine, prompt=p, max_tokens=n, drafter="none")[0] for p, n in zip(PROMPTS, lengths)]
    steps = worker.batched_steps
    jobs = [submit(worker, batch_engine, prompt=p, max_tokens=n) for p, n in zip(PROMPTS, lengths)]
    got = [results(job) for job in jobs]
    assert worker.batched_steps > steps + 100  # they really were decoded together
    for (tokens, _, last), want, n in zip(got, expected, lengths):
        assert tokens == want and last.stats.generated_tokens == n and last.finish_reason == FinishReason.LENGTH


def test_stop_strings_and_sampling_stay_per_request(worker, batch_engine):
    plain, text, _ = alone(batch_engine, prompt=PROMPTS[0], max_tokens=120, drafter="none")
    stop = text[len(text) // 2 : len(text) // 2 + 10]
    seeded = dict(prompt=PROMPTS[1], max_tokens=80, temperature=0.9, top_p=0.95, seed=42)
    sampled_alone = alone(batch_engine, **seeded)[0]
    jobs = [
        submit(worker, batch_engine, prompt=PROMPTS[0], max_tokens=120, stop=(stop,)),
        submit(worker, batch_engine, **seeded),
        submit(worker, batch_engine, prompt=PROMPTS[2], max_tokens=100),
    ]
    stopped, sampled, other = (results(job) for job in jobs)
    assert stopped[2].finish_reason == FinishReason.STOP and stopped[1] == text[: text.index(stop)]
    # A seeded request draws one key per token, alone or batched: the same samples.
    assert sampled[0] == sampled_alone
    assert other[2].stats.generated_tokens == 100


def test_a_request_cancelled_mid_batch_leaves_the_others_unharmed(worker, batch_engine):
    expected = [alone(batch_engine, prompt=p, max_tokens=150, drafter="none")[0] for p in PROMPTS[:3]]
    jobs = [submit(worker, batch_engine, prompt=p, max_tokens=150) for p in PROMPTS[:3]]
    victim = jobs[1]
    seen = 0
    for round_ in victim.results():
        seen += len(round_.token_ids)
        if seen >= 30:
            victim.cancel()
            break
    got = [results(job) for job in (jobs[0], jobs[2])]
    assert [g[0] for g in got] == [expected[0], expected[2]]
    assert worker.active == 0


def test_the_last_one_left_goes_on_alone_and_speculates_again(worker, batch_engine):
    expected = alone(batch_engine, prompt=PROMPTS[0], max_tokens=400, drafter="none")[0]
    long_job = submit(worker, batch_engine, prompt=PROMPTS[0], max_tokens=400)
    short = [submit(worker, batch_engine, prompt=p, max_tokens=30) for p in PROMPTS[1:3]]
    for job in short:
        results(job)
    tokens, _, last = results(long_job)
    assert tokens == expected
    assert last.stats.depths.get(0, 0) >= 29  # batched steps (plain)
    assert last.stats.drafted > 0  # and speculative rounds once alone


def test_a_newcomer_joins_a_running_solo_request(worker, batch_engine):
    expected = [alone(batch_engine, prompt=p, max_tokens=300, drafter="none")[0] for p in PROMPTS[:2]]
    first = submit(worker, batch_engine, prompt=PROMPTS[0], max_tokens=300)
    for n, _ in enumerate(first.results()):
        if n == 20:  # it is decoding alone, speculatively
            break
    second = submit(worker, batch_engine, prompt=PROMPTS[1], max_tokens=300)
    rest, _, last = results(first)
    tokens = expected[0][: len(expected[0]) - len(rest)] + rest  # what the first 21 rounds streamed
    assert results(second)[0] == expected[1]
    assert rest == expected[0][len(expected[0]) - len(rest) :] and len(tokens) == 300
    assert last.stats.drafted > 0, last.stats  # alone it speculated
    assert last.stats.depths.get(0, 0) > 0, last.stats  # then it decoded in the batch


def test_a_request_ended_in_a_batch_feeds_the_prompt_cache_exactly():
    """It leaves while the others' next step is already queued (that step fed its last token too): its
    prompt-cache entry holds exactly its own tokens, and the next turn continues from it as from a cold prefill."""
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=64 * 2**20))
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        prompt = engine.tokenizer.encode(PROMPTS[0])
        jobs = [
            worker.submit(engine.prepare(GenerationRequest(prompt_ids=tuple(prompt), max_tokens=40, ignore_eos=True)))
        ]
        jobs += [submit(worker, engine, prompt=p, max_tokens=120) for p in PROMPTS[1:3]]
        first, _, last = results(jobs[0])
        for job in jobs[1:]:
            results(job)
        assert last.stats.depths.get(0, 0) >= 20  # it decoded in the batch
        ((tokens, offsets),) = engine.prompt_cache.contents()  # the one that keeps its prompt (the others did not ask)
        assert tokens == prompt + first[:-1]  # all but the last token, which no forward pass has fed
        assert offsets == [len(tokens)] * len(offsets)  # its caches hold exactly those tokens
        follow_up = tuple(prompt + first + engine.tokenizer.encode(" The else clause"))
        warm = collect(
            engine.generate(GenerationRequest(prompt_ids=follow_up, max_tokens=60, ignore_eos=True, drafter="none"))
        )
        assert warm[2].stats.cached_tokens == len(prompt) + len(first) - 1  # the whole entry
        cold = alone(engine, prompt_ids=follow_up, max_tokens=60, drafter="none")
        assert cold[2].stats.cached_tokens == 0 and warm[0] == cold[0]
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def test_requests_that_end_at_the_same_step_leave_the_batch_together():
    """A burst of equal requests ends at one step: they leave in one copy of the batched cache (not one copy
    each), each keeps exactly its own cache for the prompt cache when it asked for it, and the row that
    stays goes on as alone."""
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=64 * 2**20))
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        prompts = [tuple(engine.tokenizer.encode(p)) for p in PROMPTS[:3]]
        expected = alone(engine, prompt_ids=prompts[2], max_tokens=100, drafter="none")[0]
        hold = threading.Event()
        worker.call(hold.wait)  # admitted at one turn: prefilled together, so the two short ones end together
        jobs = [
            worker.submit(
                engine.prepare(GenerationRequest(prompt_ids=p, max_tokens=n, ignore_eos=True, cache_prompt=keep))
            )
            for p, n, keep in ((prompts[0], 40, True), (prompts[1], 40, False), (prompts[2], 100, False))
        ]
        hold.set()
        got = [results(job) for job in jobs]
        assert all(g[2].stats.depths.get(0, 0) >= 30 for g in got)  # all three decoded in the batch
        # The two together, in one copy, then the last one to go on alone: two copies, not three.
        assert worker.departures == 2
        assert got[2][0] == expected
        ((tokens, offsets),) = engine.prompt_cache.contents()  # the one that asked; the other did not
        assert tokens == list(prompts[0]) + got[0][0][:-1]
        assert offsets == [len(tokens)] * len(offsets)
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def test_the_batched_release_rule_sees_a_cache_list_grow(tmp_path):
    """A CacheList layer (falcon_h1) holds its KV cache inside: the batch's growth check looks into it, so the
    pool is released when that KV cache grows, as for any other model (``runner.batch.capacity``)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from runner.batch import capacity, merge
    from tests.helpers import tiny_cache_list_model

    model, _ = load(str(tiny_cache_list_model(tmp_path / "falcon_h1")))
    caches = []
    for length in (250, 240):
        cache = make_prompt_cache(model)
        model(mx.array([[5] * length]), cache=cache)
        caches.append(cache)
    batched = merge(caches)  # buffers of exactly 250 positions: the first step grows them by 256

    def step():
        model(mx.array([[7], [7]]), cache=batched)
        mx.eval([layer.state for layer in batched])
        return capacity(batched)

    grown = step()
    assert grown and all(shape for shape in grown)  # the KV buffers inside each CacheList are seen
    shapes = {step() for _ in range(255)}  # up to 506 positions: the same buffers
    assert shapes == {grown}
    assert step() != grown  # past them: the KV buffers grew again


def test_joint_groups_share_passes_within_their_limits():
    planner = PrefillPlanner(heads=9)  # first chunk 128 tokens, scores up to 64 MB
    assert joint_groups([(40, 15)] * 16, planner) == [list(range(16))]  # 240 tokens: one pass
    assert joint_groups([(0, 100)] * 3, planner) == [[0, 1], [2]]  # 300 tokens would pass 256
    assert joint_groups([(0, 10), (0, 200), (0, 10)], planner) == [[1], [0, 2]]  # 200 > a first chunk: alone
    # A long cache prefills alone; the short rows around it share a pass of their own.
    assert joint_groups([(100_000, 100), (10, 10), (10, 10)], planner) == [[0], [1, 2]]
    # Copying caches of more than 512 tokens into a shared pass and out again costs more than it saves.
    assert joint_groups([(400, 50), (400, 50), (500, 20), (30_000, 10)], planner) == [[2], [3], [0, 1]]


def test_short_prompts_that_wait_together_share_a_prefill_pass():
    """Requests admitted at the same turn - some continuing a cached conversation, so their caches differ in
    length - are prefilled in one batched pass (right padded, rolled left, then each row extracted), and each
    decodes exactly as it would alone."""
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=64 * 2**20))
    worker = MlxWorker(engine, max_queue=8, max_batch=8)
    worker.start()
    try:
        first = results(submit(worker, engine, prompt=PROMPTS[0], max_tokens=30, cache_prompt=True))
        turn = PROMPTS[0] + first[1]
        prompts = [
            turn + " The break statement",
            turn + " Note that a for loop ends when the sequence is exhausted",
            PROMPTS[1],
            PROMPTS[2],
            PROMPTS[3],
        ]
        expected = [alone(engine, prompt=p, max_tokens=40, drafter="none")[0] for p in prompts]
        hold, joint = threading.Event(), worker.joint_prefills
        worker.call(hold.wait)  # the MLX thread waits while every request is queued: one turn admits them all
        jobs = [submit(worker, engine, prompt=p, max_tokens=40, cache_prompt=True) for p in prompts]
        hold.set()
        got = [results(job) for job in jobs]
        assert worker.joint_prefills == joint + 1
        assert got[0][2].stats.cached_tokens > 30 and got[1][2].stats.cached_tokens > 30
        assert [g[2].stats.cached_tokens for g in got[2:]] == [0, 0, 0]
        assert [g[0] for g in got] == expected
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def test_requests_wait_while_their_caches_would_not_fit_next_to_the_others(batch_engine):
    """A batch-memory budget of two rows' projected caches: of four requests, two decode at a time, the others
    wait in the queue (not refused), and every one gives the tokens it gives alone."""
    cost = batch_engine.cache_cost
    engine = Engine(
        batch_engine.target, batch_engine.draft, RunnerSettings(prompt_cache=0, batch_memory=cost.batch([256, 256]))
    )
    worker = MlxWorker(engine, max_queue=8, max_batch=8)
    worker.start()
    try:
        expected = [alone(batch_engine, prompt=p, max_tokens=60, drafter="none")[0] for p in PROMPTS[:4]]
        with most_active(worker) as peak:
            jobs = [submit(worker, engine, prompt=p, max_tokens=60) for p in PROMPTS[:4]]  # each fits in 256 positions
            got = [results(job) for job in jobs]
        assert peak.most == 2 and worker.batched_steps > 60
        assert [g[0] for g in got] == expected
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def test_the_pool_stays_bounded_over_a_long_batched_generation(restore_cache_limit):
    """Pool cap raised to the memory limit: without releases at the batch's growth steps, the pool keeps
    every buffer the batched cache outgrew (four rows of 1200 tokens: four growths of 256 positions)."""
    peaks = {}
    for release in (True, False):
        engine = Engine.load(
            DEFAULT_TARGET,
            DEFAULT_DRAFT,
            RunnerSettings(prompt_cache=0, cache_limit=CACHE_LIMIT_UNBOUNDED, release_enabled=release),
        )
        # Read one after the other: the others' rounds wait meanwhile (more than a slow client's bound).
        worker = MlxWorker(engine, max_queue=8, max_batch=4, max_pending_rounds=10_000)
        worker.start()
        mx.clear_cache()
        peak, done = 0, threading.Event()

        def watch(done=done):
            nonlocal peak
            while not done.is_set():
                peak = max(peak, mx.get_cache_memory())
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        jobs = [submit(worker, engine, prompt=p, max_tokens=1200) for p in PROMPTS[:4]]
        outs = [results(job) for job in jobs]
        done.set()
        watcher.join()
        worker.stop(cancel_running=True)
        worker.join(10)
        assert all(o[2].stats.generated_tokens == 1200 for o in outs)
        peaks[release] = peak
    # The batched KV cache: 4 rows x 1280 positions of the target's 8 layers (the draft does not batch).
    batch_cache = 4 * 8 * 2 * 2 * 64 * 4 * 1280
    print(f"pool peak with release {peaks[True] / 2**20:.1f} MB, without {peaks[False] / 2**20:.1f} MB")
    assert peaks[True] < 3 * batch_cache + 16 * 2**20
    assert peaks[False] > 2 * peaks[True]


def test_a_client_that_does_not_read_is_stopped_and_the_others_keep_going(engine):
    """Back-pressure: rounds waiting for a client that does not read are bounded; past the bound its request
    ends with ClientTooSlow (RESOURCE_EXHAUSTED), after the rounds already there, and its row goes to others."""
    from common.errors import ClientTooSlow

    worker = MlxWorker(engine, max_queue=8, max_batch=4, max_pending_rounds=8)
    worker.start()
    try:
        fields = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True, "cache_prompt": False}
        stalled = worker.submit(engine.prepare(GenerationRequest(**fields)))
        reader = worker.submit(engine.prepare(GenerationRequest(**fields, drafter="none")))
        tokens = [t for r in reader.results() for t in r.token_ids]  # read as it comes: all of it
        assert len(tokens) == 120
        got = []
        with pytest.raises(ClientTooSlow, match="reads too slowly"):
            for round_ in stalled.results():
                got.append(round_)
        assert 8 <= len(got) <= 9 and stalled.rounds.get_nowait() is None  # then only its end
        assert worker.active == 0
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)


def test_a_reader_that_falls_behind_gets_the_waiting_rounds_as_one(worker, batch_engine):
    """The runner's stream coalesces (Job.results(coalesce=True)): rounds waiting when the reader comes back go
    as one message - the same tokens and text, the last one's end and stats - not a backlog of small ones."""
    expected, text, _ = alone(batch_engine, prompt=PROMPTS[1], max_tokens=40, drafter="none")
    job = submit(worker, batch_engine, prompt=PROMPTS[1], max_tokens=40, drafter="none")
    deadline = time.monotonic() + 120
    while not (job.rounds.queue and job.rounds.queue[-1] is None) and time.monotonic() < deadline:
        time.sleep(0.01)  # not reading: the answer's rounds wait in the job's queue
    assert job.rounds.qsize() > 10
    rounds = list(job.results(coalesce=True))
    assert len(rounds) == 1
    assert rounds[0].token_ids == expected and rounds[0].text == text
    assert rounds[0].finish_reason == FinishReason.LENGTH and rounds[0].stats.generated_tokens == 40


def test_a_stream_that_holds_gathers_its_tokens_into_fewer_messages(worker, batch_engine):
    """stream_interval (runner.server holds while many requests decode): a reader that gathers for a while after
    each round reads several tokens a message - the answer unchanged, its end not held back."""
    expected, text, _ = alone(batch_engine, prompt=PROMPTS[2], max_tokens=60, drafter="none")
    job = submit(worker, batch_engine, prompt=PROMPTS[2], max_tokens=60, drafter="none")
    started = time.monotonic()
    rounds = list(job.results(coalesce=True, hold=lambda: 0.2))
    assert len(rounds) < 30  # 20 tok/s or more: 4 or more a message; one a message without holding
    assert [t for r in rounds for t in r.token_ids] == expected and "".join(r.text for r in rounds) == text
    assert rounds[-1].finish_reason == FinishReason.LENGTH and time.monotonic() - started < 60
