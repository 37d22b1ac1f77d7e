"""OpenAI's logit_bias in the runner: a number added to chosen tokens' logits before every choice, in plain,
speculative and batched decoding (the default pair, in-process)."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from runner.request import GenerationRequest
from runner.worker import MlxWorker
from tests.helpers import collect

PROMPT = "The for statement is used to iterate over the elements of a sequence"


def greedy(engine, **fields):
    fields = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "cache_prompt": False, **fields}
    return collect(engine.generate(GenerationRequest(**fields)))[0]


@pytest.fixture(scope="module")
def free(engine):
    return greedy(engine, drafter="none")


def test_a_bias_changes_the_choice(engine, free):
    banned = greedy(engine, drafter="none", logit_bias=((free[0], -100.0),))
    assert banned[0] != free[0] and free[0] not in banned
    forced = greedy(engine, drafter="none", logit_bias=((free[5], 100.0),))
    assert set(forced) == {free[5]}
    assert greedy(engine, drafter="none", logit_bias=((free[0], 0.0),)) == free


@pytest.mark.parametrize(("drafter", "k"), [("model", 3), ("model", None), ("ngram", 2)])
def test_greedy_under_a_bias_is_the_same_with_every_drafter(engine, free, drafter, k):
    bias = ((free[0], -100.0), (free[3], -5.0), (free[10], 3.0))
    alone = greedy(engine, drafter="none", logit_bias=bias)
    assert alone != free
    assert greedy(engine, drafter=drafter, num_draft_tokens=k, logit_bias=bias) == alone


def test_a_biased_row_in_a_batch_equals_it_alone(engine, free):
    bias = ((free[0], -100.0), (free[3], -5.0))
    alone = greedy(engine, drafter="none", logit_bias=bias)
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        steps = worker.batched_steps
        fields = {"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "cache_prompt": False}
        jobs = [
            worker.submit(engine.prepare(GenerationRequest(**fields, logit_bias=bias))),
            worker.submit(engine.prepare(GenerationRequest(**fields))),
        ]
        got = [[t for r in job.results() for t in r.token_ids] for job in jobs]
        assert worker.batched_steps > steps + 10
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
    assert got == [alone, free]


def test_bad_biases_are_refused_naming_the_field(engine):
    for bias in (((engine.vocab_size, 1.0),), ((5, 101.0),), ((5, float("nan")),), tuple((t, 1.0) for t in range(301))):
        with pytest.raises(InvalidRequest) as caught:
            engine.prepare(GenerationRequest(prompt=PROMPT, logit_bias=bias))
        assert caught.value.field == "logit_bias"
