"""Presence, frequency and repetition penalties (runner.penalties): on the logits before every choice, in
plain, speculative and batched decoding (the default pair, in-process), and through both APIs (SmolLM2, the
official ``openai`` client and gRPC)."""

from __future__ import annotations

import collections

import grpc
import mlx.core as mx
import numpy as np
import openai
import pytest

from common.errors import InvalidRequest
from runner.penalties import Penalties
from runner.request import GenerationRequest
from runner.worker import MlxWorker
from supervisor.protocol import supervisor_pb2
from tests.helpers import collect

PROMPT = "The for statement is used to iterate over the elements of a sequence"
PENALTIES = {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.4}


def reference(logits, prompt, answer, presence, frequency, repetition):
    """The penalised logits after ``answer``, one token at a time, in plain numpy."""
    out = np.array(logits, dtype=np.float64)
    counts = collections.Counter(answer)
    for token in set(prompt) | set(answer):
        if repetition != 1.0:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
    for token, count in counts.items():
        out[token] -= frequency * count + presence
    return out


def test_each_row_of_a_round_sees_the_tokens_before_it():
    rng = np.random.default_rng(0)
    vocab, prompt, answer, drafts = 32, [1, 2, 3], [3, 4, 4], [4, 5, 6]
    penalties = Penalties(vocab, prompt, 0.7, 0.3, 1.6)
    penalties.count(answer[:2])
    penalties.count(mx.array(answer[2]))  # a token still on the device, as a pipelined round counts it
    logits = rng.normal(size=(len(drafts) + 1, vocab)).astype(np.float32)
    rows = np.array(penalties.apply(mx.array(logits), before=drafts))
    for i in range(len(drafts) + 1):
        np.testing.assert_allclose(rows[i], reference(logits[i], prompt, answer + drafts[:i], 0.7, 0.3, 1.6), rtol=1e-5)
    assert not Penalties.wanted(0.0, 0, 1.0) and Penalties.wanted(0, 0, 1.1)


def greedy(engine, **fields):
    fields = {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "cache_prompt": False, **fields}
    return collect(engine.generate(GenerationRequest(**fields)))[0]


@pytest.fixture(scope="module")
def free(engine):
    return greedy(engine, drafter="none")


@pytest.fixture(scope="module")
def penalised(engine):
    return greedy(engine, drafter="none", **PENALTIES)


def test_penalties_cut_repetition(free, penalised):
    """The default pair repeats itself greedily; penalised, its most repeated token comes far less often."""
    assert penalised != free
    assert max(collections.Counter(penalised).values()) < max(collections.Counter(free).values())


@pytest.mark.parametrize(("drafter", "k"), [("model", 3), ("model", None), ("ngram", 2)])
def test_greedy_under_penalties_is_the_same_with_every_drafter(engine, penalised, drafter, k):
    assert greedy(engine, drafter=drafter, num_draft_tokens=k, **PENALTIES) == penalised


def test_a_penalised_row_in_a_batch_equals_it_alone(engine, free, penalised):
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        steps = worker.batched_steps
        fields = {"prompt": PROMPT, "max_tokens": 48, "ignore_eos": True, "cache_prompt": False}
        jobs = [
            worker.submit(engine.prepare(GenerationRequest(**fields, **PENALTIES))),
            worker.submit(engine.prepare(GenerationRequest(**fields))),
        ]
        got = [[t for r in job.results() for t in r.token_ids] for job in jobs]
        assert worker.batched_steps > steps + 10
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
    assert got == [penalised, free]


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", float("nan")),
    ],
)
def test_out_of_range_penalties_are_refused_naming_the_field(engine, field, value):
    with pytest.raises(InvalidRequest) as caught:
        engine.prepare(GenerationRequest(prompt=PROMPT, **{field: value}))
    assert caught.value.field == field


CAPITAL = [{"role": "user", "content": "List the numbers from one to twenty."}]


def test_both_apis_take_the_penalties(chat_client, chat_supervisor):
    def ask(**fields):
        return (
            chat_client.chat.completions.create(model="smol", messages=CAPITAL, max_tokens=40, temperature=0, **fields)
            .choices[0]
            .message.content
        )

    free = ask()
    assert ask(frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3}) != free
    with pytest.raises(openai.BadRequestError) as caught:
        ask(presence_penalty=3)
    assert caught.value.body["param"] == "presence_penalty" and "[-2, 2]" in caught.value.body["message"]
    request = supervisor_pb2.GenerateRequest(model="smol", max_tokens=8, repetition_penalty=-1)
    request.messages.add(role="user", content="hi")
    with pytest.raises(grpc.RpcError) as caught:
        list(chat_supervisor.client.stub.Generate(request, timeout=60, metadata=chat_supervisor.client.metadata))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "repetition_penalty" in caught.value.details()
