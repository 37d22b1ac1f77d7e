"""Constrained decoding in the runner (runner.constraint): a grammar decides which tokens may come next.

On the default pair, in-process: every output matches its grammar; greedy output
is the same with every drafter and with the forced tokens fed as certain drafts;
sampling under a grammar while speculating keeps the target's masked
distribution; batched rows under grammars (beside free ones) equal each alone;
bad grammars are refused naming the field.
"""

from __future__ import annotations

import json
import re
import time

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from common.errors import InvalidRequest
from common.requests import FinishReason
from runner.constraint import Constraint, ConstraintBroken, Grammars, apply_masks, bounded_integers
from runner.request import GenerationRequest
from runner.worker import MlxWorker
from tests.helpers import collect
from tests.test_engine_sampling import chi_square

PROMPT = "The for statement is used to iterate over the elements of a sequence. As JSON:"
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"enum": ["for", "while", "if", "else"]}, "minItems": 1, "maxItems": 4},
        "ratio": {"type": "number"},
        "done": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "done"],
    "additionalProperties": False,
}
GRAMMARS = {
    "json_schema": json.dumps({"json_schema": RECORD}),
    "json_object": json.dumps({"json_object": True}),
    "regex": json.dumps({"regex": r"(for|while) [a-z]{2,8}( [a-z]{2,8}){0,3}\."}),
    "lark": json.dumps({"lark": 'start: "items: " item ("," item)*\nitem: /[a-z]{1,6}/'}),
}


def run(engine, grammar: str, **fields):
    fields = {"prompt": PROMPT, "max_tokens": 96, "cache_prompt": False, "grammar": grammar, **fields}
    tokens, text, last = collect(engine.generate(GenerationRequest(**fields)))
    return tokens, text, last


def matches(kind: str, text: str) -> bool:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), RECORD)
        return True
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(r"(for|while) [a-z]{2,8}( [a-z]{2,8}){0,3}\.", text) is not None
    return re.fullmatch(r"items: [a-z]{1,6}(,[a-z]{1,6})*", text) is not None


@pytest.fixture(scope="module")
def plain_outputs(engine):
    return {kind: run(engine, grammar, drafter="none") for kind, grammar in GRAMMARS.items()}


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_output_matches_its_grammar_and_ends_there(plain_outputs, kind):
    tokens, text, last = plain_outputs[kind]
    if last.finish_reason == FinishReason.STOP or kind == "json_schema":  # bounded: it must end
        assert last.finish_reason == FinishReason.STOP, text
        assert matches(kind, text), text
    else:  # an open-ended grammar may run to max_tokens (the default pair writes one long key)
        assert last.finish_reason == FinishReason.LENGTH and text


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize(("drafter", "k"), [("model", 2), ("model", 5), ("model", None), ("ngram", 3)])
def test_greedy_under_a_grammar_is_the_same_with_every_drafter(engine, plain_outputs, kind, drafter, k):
    tokens, text, last = run(engine, GRAMMARS[kind], drafter=drafter, num_draft_tokens=k)
    assert tokens == plain_outputs[kind][0] and text == plain_outputs[kind][1]


def test_forced_tokens_go_into_the_forward_pass_as_certain_drafts(engine, plain_outputs):
    """A JSON schema with fixed keys and no whitespace forces most of its tokens: a plain decoder under it
    emits them without a drafter, several a pass, all kept."""
    tokens, text, last = plain_outputs["json_schema"]
    stats = last.stats
    assert stats.forced > len(tokens) // 4 and stats.drafted == stats.accepted == 0  # certain, not drafts
    assert stats.rounds < len(tokens) - stats.forced // 2
    # No whitespace between JSON tokens (a model cannot run away in it, Ollama's #18567): the compact form.
    assert json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False) == text


@pytest.mark.parametrize("kind", ["json_schema", "regex", "lark"])
def test_a_queued_pass_under_a_grammar_changes_nothing_but_when_the_pass_runs(engine, plain_outputs, kind, monkeypatch):
    """A constrained round may queue the pass of its token before the host reads it (the device runs it while the
    grammar takes the token and works out the next mask). With every round that forced nothing queuing one, the
    tokens, their logprobs and a seeded sample are those of rounds that queue nothing."""
    from runner import decoders

    round_ = decoders.Decoder._constrained_round
    started_queued = []

    def recording(self, budget, k, pipeline=None):
        started_queued.append(self._pass is not None)
        return round_(self, budget, k, pipeline)

    def unqueued(self, budget, k, pipeline=None):
        return round_(self, budget, k, False)

    def answer(**fields):
        request = GenerationRequest(prompt=PROMPT, max_tokens=96, cache_prompt=False, grammar=GRAMMARS[kind], **fields)
        rounds = list(engine.generate(request))
        return [t for r in rounds for t in r.token_ids], [p.logprob for r in rounds for p in r.logprobs]

    greedy, sampled = dict(drafter="none", logprobs=True), dict(drafter="none", temperature=0.8, seed=7, logprobs=True)
    monkeypatch.setattr(decoders, "LONG_RUN", 1)
    monkeypatch.setattr(decoders.Decoder, "_constrained_round", recording)
    queued = [answer(**greedy), answer(**sampled)]
    monkeypatch.setattr(decoders.Decoder, "_constrained_round", unqueued)
    alone = [answer(**greedy), answer(**sampled)]
    assert queued[0][0] == plain_outputs[kind][0]
    assert sum(started_queued) >= len(queued[0][0]) // 4  # each free run's rounds after its first
    for (tokens, logprobs), (tokens_alone, logprobs_alone) in zip(queued, alone):
        assert tokens == tokens_alone  # (a row from a one-token pass differs from one of a longer pass by rounding)
        assert logprobs == pytest.approx(logprobs_alone, abs=1e-4)


def test_rounds_queue_passes_inside_long_free_runs_only(engine, monkeypatch):
    """A form's short values (a forced run after every few free tokens) queue no pass, which would cost each forced
    run a pass of its own; free text under a grammar that forces nothing queues its passes."""
    from runner import decoders

    round_ = decoders.Decoder._constrained_round
    started_queued = []

    def recording(self, budget, k, pipeline=None):
        started_queued.append(self._pass is not None)
        return round_(self, budget, k, pipeline)

    monkeypatch.setattr(decoders.Decoder, "_constrained_round", recording)
    fields = {f"field_{i}": {"type": "integer", "minimum": 0, "maximum": 99} for i in range(8)}
    form = {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}
    run(engine, json.dumps({"json_schema": form}), drafter="none", max_tokens=96)
    short_runs = list(started_queued)
    started_queued.clear()
    run(engine, json.dumps({"regex": "[a-z ]{1,400}"}), drafter="none", max_tokens=48)
    assert sum(short_runs) <= len(short_runs) // 4
    assert sum(started_queued) >= len(started_queued) // 2


def test_a_bad_grammar_is_refused_naming_the_field(engine):
    bad = [
        "not json",
        json.dumps({"yaml": "x"}),
        json.dumps({"json_schema": "a string"}),
        json.dumps({"json_schema": {"type": "object", "properties": {"a": {"type": "strange"}}}}),
        json.dumps({"regex": "(unclosed"}),
        json.dumps({"lark": "start: undefined_rule"}),
    ]
    for grammar in bad:
        with pytest.raises(InvalidRequest) as caught:
            engine.prepare(GenerationRequest(prompt=PROMPT, grammar=grammar))
        assert caught.value.field == "grammar", grammar


def test_a_pathological_grammar_is_refused_quickly_and_the_engine_goes_on(engine, plain_outputs):
    """A schema whose grammar would be huge (300 alternatives of growing objects) is refused within seconds by
    llguidance's limits, and the engine serves the next request as before."""
    huge = {
        "anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(j)}} for j in range(300)]
    }
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as caught:
        engine.prepare(GenerationRequest(prompt=PROMPT, grammar=json.dumps({"json_schema": huge})))
    assert caught.value.field == "grammar" and time.perf_counter() - started < 5
    tokens, _, _ = run(engine, GRAMMARS["json_schema"], drafter="none")
    assert tokens == plain_outputs["json_schema"][0]


def test_integers_without_bounds_get_jsons_interoperable_bounds():
    """SmolLM2 at temperature 1 wrote an unbounded integer's digits until max_tokens: such integers are bounded
    to +-(2**53 - 1); bounded ones and other types are left as they are."""
    schema = {
        "type": "object",
        "properties": {
            "free": {"type": "integer"},
            "low": {"type": "integer", "minimum": 3},
            "items": {"type": "array", "items": {"type": "integer"}},
            "name": {"type": "string"},
        },
    }
    bounded = bounded_integers(schema)
    props = bounded["properties"]
    assert (props["free"]["minimum"], props["free"]["maximum"]) == (-(2**53 - 1), 2**53 - 1)
    assert props["low"] == {"type": "integer", "minimum": 3} and props["name"] == {"type": "string"}
    assert props["items"]["items"]["maximum"] == 2**53 - 1 and "maximum" not in schema["properties"]["free"]


def test_masks_are_applied_per_row():
    logits = mx.zeros((3, 20))
    allow = np.zeros(4, dtype=np.uint8)
    allow[0] = 0b00000110  # tokens 1 and 2
    allow[2] = 0b00000001  # token 16
    masked = np.array(apply_masks(logits, [allow, None, allow]))
    assert np.isfinite(masked[0]).tolist() == [t in (1, 2, 16) for t in range(20)]
    assert np.isfinite(masked[1]).all() and (masked[0] == masked[2]).all()
    assert Constraint.allows(allow, 16) and not Constraint.allows(allow, 3) and not Constraint.allows(allow, 400)


def _literal(text: str) -> str:
    return "".join(c if c.isalnum() or c == " " else "\\" + c for c in text)


def test_sampling_under_a_grammar_keeps_the_targets_masked_distribution(engine):
    """The first token of a sampled answer under a grammar, while the draft model proposes, follows the target's
    distribution masked by the grammar: chi-square against the exact masked softmax. The grammar forbids the
    draft's favourite token and allows its next ones (and the target's), so drafts are often forbidden (cut
    after the first forbidden one, which the target then rejects) and often kept. (This test cannot tell a
    forbidden draft rejected through the residual from one replaced by a fresh draw from p: with these models
    the two differ by less than its noise. The rule is in runner/decoders.py's _constrained_round.)"""
    ids = engine.prepare(GenerationRequest(prompt=PROMPT)).prompt_ids
    logits = engine.target.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
    p = np.array(mx.softmax(logits))
    q = np.array(mx.softmax(engine.draft.model(mx.array(ids)[None])[0, -1].astype(mx.float32)))
    texts = []
    for token in [int(t) for t in np.argsort(-q)[1:4]] + [int(t) for t in np.argsort(-p)[:3]]:
        text = engine.tokenizer.decode([token])
        if token != int(np.argmax(q)) and text.strip() and text not in texts:
            texts.append(text)
    grammar = json.dumps({"regex": "(" + "|".join(_literal(t) for t in texts) + ")[a-z ]{0,12}"})
    mask = engine.prepare(GenerationRequest(prompt=PROMPT, grammar=grammar)).constraint.mask()
    assert not Constraint.allows(mask, int(np.argmax(q)))
    masked = np.array(mx.softmax(apply_masks(logits[None], [mask])[0]))
    likely = [int(t) for t in np.argsort(-masked)[:5] if masked[t] > 0.03]
    assert len(likely) >= 2  # a real choice, not a point mass
    trials = 400
    counts = np.zeros(len(likely) + 1)
    for seed in range(trials):
        request = GenerationRequest(
            prompt=PROMPT,
            grammar=grammar,
            temperature=1.0,
            seed=seed,
            max_tokens=4,
            drafter="model",
            num_draft_tokens=3,  # the prompt comes from the prompt cache after the first trial
        )
        first = collect(engine.generate(request))[0][0]
        counts[likely.index(first) if first in likely else -1] += 1
    expected = np.append(masked[likely], 1 - masked[likely].sum())
    assert chi_square(counts, expected) < 20.5  # df <= 5, p = 0.001


def test_batched_rows_under_grammars_equal_each_alone(engine, plain_outputs):
    """Constrained and free requests decoded together: each row's tokens equal its tokens alone."""
    free = {"prompt": "A class definition defines a class object", "max_tokens": 60, "ignore_eos": True}
    alone_free = collect(engine.generate(GenerationRequest(**free, drafter="none", cache_prompt=False)))[0]
    worker = MlxWorker(engine, max_queue=16, max_batch=8)
    worker.start()
    try:
        steps = worker.batched_steps
        jobs = {
            kind: worker.submit(
                engine.prepare(
                    GenerationRequest(prompt=PROMPT, max_tokens=96, cache_prompt=False, grammar=GRAMMARS[kind])
                )
            )
            for kind in GRAMMARS
        }
        free_job = worker.submit(engine.prepare(GenerationRequest(**free, cache_prompt=False)))
        got = {kind: [t for r in job.results() for t in r.token_ids] for kind, job in jobs.items()}
        got_free = [t for r in free_job.results() for t in r.token_ids]
        assert worker.batched_steps > steps + 10  # they really were decoded together
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
    assert got_free == alone_free
    for kind in GRAMMARS:
        assert got[kind] == plain_outputs[kind][0], kind


def test_a_complete_grammar_allows_every_end_token(engine):
    """Every token that may end an answer (EOS and the template's end of turn) is allowed once the grammar is
    complete, not only the tokenizer's EOS."""
    grammars = Grammars(engine.tokenizer, engine.vocab_size, end_ids={1, 2})
    constraint = grammars.constraint(json.dumps({"regex": "ab"}))
    for token in engine.tokenizer.encode("ab", add_special_tokens=False):
        constraint.consume(token)
    mask = constraint.mask()
    assert Constraint.allows(mask, 1) and Constraint.allows(mask, 2)


def test_a_grammar_that_fails_mid_answer_ends_only_its_request(engine, monkeypatch):
    """A matcher that refuses a token at decode time (a grammar past llguidance's limits: not something a test
    can cause on purpose, so a stand-in raises it) ends that request with an INVALID_ARGUMENT-kind error; a
    request decoding beside it finishes, and the worker goes on."""
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        broken = engine.prepare(
            GenerationRequest(prompt=PROMPT, grammar=GRAMMARS["json_schema"], max_tokens=60, cache_prompt=False)
        )
        calls = [0]
        consume = broken.constraint.consume

        def failing(token):
            calls[0] += 1
            if calls[0] > 5:
                raise ConstraintBroken("a stand-in failure")
            consume(token)

        monkeypatch.setattr(broken.constraint, "consume", failing)
        free = GenerationRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True, cache_prompt=False)
        jobs = [worker.submit(broken), worker.submit(engine.prepare(free))]
        with pytest.raises(ConstraintBroken):
            list(jobs[0].results())
        assert sum(len(r.token_ids) for r in jobs[1].results()) == 40
        after = worker.submit(engine.prepare(free))
        assert sum(len(r.token_ids) for r in after.results()) == 40
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
