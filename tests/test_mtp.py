"""A model's own MTP layers as the drafter (runner/drafting/mtp.py), on the tiny random-weight checkpoints of
models/train_mtp.py (``make mtp-model``): DeepSeek-V3's layout (an extra ``model.layers.N``; GLM-4.5's names its
layer the same way, on another architecture) and Qwen3.5's
(``mtp.*``, on a hybrid target whose recurrent layers are restored and fed again after a rejection).

Random weights: the drafts are rarely kept. These tests check loading, drafting and that the output is the target's.
The ``*_trained`` copies' MTP layers learnt the target's answer to PROMPT: there their drafts are kept, which
checks the rounds that keep drafts (an overfit layer: it says nothing about a real model's acceptance).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.footprint import ModelFootprint
from common.requests import InvalidRequest
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from tests.helpers import batched_and_alone, collect, tiny_hybrid_model

MTP_DIR = Path(__file__).resolve().parents[1] / "models" / "mtp"
LAYOUTS = ("deepseek_v3", "qwen3_5")  # each also with a trained copy
ALSO = ("glm4_moe",)  # random only
PROMPT = "The for statement is used to iterate over the elements of a sequence"
TOKENS = 40

pytestmark = pytest.mark.skipif(not (MTP_DIR / "glm4_moe").is_dir(), reason="make mtp-model")


def greedy(engine, **fields):
    tokens, _, last = collect(
        engine.generate(
            GenerationRequest(prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False, **fields)
        )
    )
    return tokens, last.stats


@pytest.fixture(scope="module", params=LAYOUTS + ALSO)
def mtp_engine(request):
    return Engine.load(MTP_DIR / request.param, settings=RunnerSettings(dtype="float32"))


@pytest.fixture(scope="module")
def plain(mtp_engine):
    return greedy(mtp_engine, drafter="none")[0]


def test_it_loads_with_its_mtp_layer_and_drafts_with_it_by_default(mtp_engine):
    assert mtp_engine.target.mtp is not None
    assert mtp_engine.drafters["mtp"] == ""
    assert mtp_engine.default_drafter == "mtp" and mtp_engine.speculative
    assert "MTP" in mtp_engine.speculative_note
    _, stats = greedy(mtp_engine)
    assert stats.drafter == "mtp" and stats.drafted > 0


def test_the_memory_estimate_counts_the_mtp_weights(mtp_engine):
    from mlx.utils import tree_flatten

    footprint = ModelFootprint.of(mtp_engine.target.path)
    mtp = sum(v.size for _, v in tree_flatten(mtp_engine.target.mtp.parameters()))
    target = sum(v.size for _, v in tree_flatten(mtp_engine.target.model.parameters()))
    assert footprint.parameters >= target + mtp


def test_the_memory_estimate_counts_the_mtp_layers_cache(mtp_engine):
    """The MTP layer keeps a KV cache over the positions it is fed: the estimate's KV counts it beside the target's."""
    import dataclasses

    import mlx.core as mx

    from runner.drafting.mtp import HiddenModel, MTPDrafter
    from runner.sampling import SamplingParams

    target = mtp_engine.target
    drafter = MTPDrafter(target.model, target.mtp)
    model = HiddenModel(target.model, drafter.hidden)
    context = [(7 * i) % 1000 + 3 for i in range(300)]
    model(mx.array(context[:-1])[None], cache=model.make_cache())
    drafter.propose(context, 1, SamplingParams(), None)
    mx.eval(drafter.cache.state)
    footprint = ModelFootprint.of(target.path)
    assert footprint.mtp_layers >= 1
    without = dataclasses.replace(footprint, mtp_layers=0)
    counted = footprint.kv_bytes("float32", len(context)) - without.kv_bytes("float32", len(context))
    assert 0 < drafter.cache.nbytes <= counted  # (DeepSeek's MLA caches less than the heads' width: over-counted)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_with_a_fixed_depth_equals_plain(mtp_engine, plain, k):
    tokens, stats = greedy(mtp_engine, drafter="mtp", num_draft_tokens=k)
    assert tokens == plain
    assert stats.drafter == "mtp" and stats.drafted > 0 and max(stats.depths) <= k


def test_greedy_with_the_adaptive_depth_equals_plain(mtp_engine, plain):
    tokens, stats = greedy(mtp_engine, drafter="mtp")
    assert tokens == plain
    assert stats.drafted > 0


def test_sampled_requests_draft_with_their_distributions(mtp_engine):
    tokens, stats = greedy(mtp_engine, drafter="mtp", num_draft_tokens=2, temperature=0.8, seed=3)
    again, _ = greedy(mtp_engine, drafter="mtp", num_draft_tokens=2, temperature=0.8, seed=3)
    assert len(tokens) == TOKENS and tokens == again and stats.drafted > 0


def test_a_model_without_mtp_layers_refuses_the_mtp_drafter(tmp_path):
    folder = tiny_hybrid_model(tmp_path / "lfm2")
    engine = Engine.load(folder, settings=RunnerSettings(dtype="float32"))
    assert engine.target.mtp is None and engine.default_drafter == "ngram"
    assert "no MTP layers" in engine.drafters["mtp"]
    with pytest.raises(InvalidRequest, match="'mtp' is not available: .* has no MTP layers"):
        greedy(engine, drafter="mtp")
    pinned = Engine.load(folder, settings=RunnerSettings(dtype="float32", drafter="mtp"))
    assert not pinned.speculative and "no MTP layers" in pinned.speculative_note


def test_its_incremental_drafts_equal_drafts_from_scratch(mtp_engine, monkeypatch):
    """The layer's cache, fed round by round (kept positions only, its chained steps trimmed, a hybrid target's
    rewinds fed again), drafts what a fresh layer fed the target's hidden states of the whole context drafts."""
    incremental_equals_scratch(mtp_engine, monkeypatch)


def incremental_equals_scratch(mtp_engine, monkeypatch):
    import mlx.core as mx

    from runner.drafting.mtp import HiddenModel, MTPDrafter
    from runner.sampling import SamplingParams

    seen = []
    propose = MTPDrafter.propose

    def recording(self, context, k, params, key):
        proposal = propose(self, context, k, params, key)
        if proposal is not None:
            seen.append((list(context), proposal.tokens.tolist()[0]))
        return proposal

    monkeypatch.setattr(MTPDrafter, "propose", recording)
    greedy(mtp_engine, drafter="mtp", num_draft_tokens=3)
    monkeypatch.undo()
    assert len(seen) >= 5
    target = mtp_engine.target
    for context, first in seen[:: max(1, len(seen) // 6)]:
        fresh = MTPDrafter(target.model, target.mtp)
        model = HiddenModel(target.model, fresh.hidden)
        model(mx.array(context[:-1])[None], cache=model.make_cache())
        again = fresh.propose(context, 1, SamplingParams(), None)
        assert again.tokens.tolist()[0] == first


@pytest.fixture(scope="module", params=[f"{layout}_trained" for layout in LAYOUTS])
def trained(request):
    engine = Engine.load(MTP_DIR / request.param, settings=RunnerSettings(dtype="float32"))
    return engine, greedy(engine, drafter="none")[0]


@pytest.mark.parametrize("k", [1, 2, 3, None])
def test_a_layer_that_predicts_well_has_its_drafts_kept(trained, k):
    engine, plain = trained
    tokens, stats = greedy(engine, drafter="mtp", num_draft_tokens=k)
    assert tokens == plain
    assert stats.drafted > 0 and stats.accepted >= 0.8 * stats.drafted
    if k is not None:
        assert stats.rounds < TOKENS  # rounds that kept drafts emitted several tokens


def test_its_incremental_drafts_equal_drafts_from_scratch_when_drafts_are_kept(trained, monkeypatch):
    incremental_equals_scratch(trained[0], monkeypatch)


def test_after_a_prompt_cache_hit_it_drafts_from_what_the_target_runs(trained):
    """A hit's prefix never runs through the target in this request. The entry keeps the MTP layer's cache beside
    the target's, and the prefix's last token runs again, so the layer goes on from where it was: the same drafts
    as without the hit (DeepSeek-V3). The hybrid Qwen3.5's recurrent layers cannot be trimmed back to run that token
    again: its layer drafts from the positions after the hit; the output is the target's either way. Through the
    worker, as a runner serves it: only a prefilled state serves the hybrid's same prompt again, which the worker
    keeps for a prompt past ``KEEP_PREFILL_TOKENS`` (``Engine.keep_prefill``)."""
    from runner.engine import KEEP_PREFILL_TOKENS
    from runner.worker import MlxWorker

    engine = trained[0]
    prompt = " ".join([PROMPT] * (KEEP_PREFILL_TOKENS // 10))
    assert len(engine.prepare(GenerationRequest(prompt=prompt)).prompt_ids) > KEEP_PREFILL_TOKENS
    fields = dict(prompt=prompt, max_tokens=16, ignore_eos=True)
    expected = collect(engine.generate(GenerationRequest(**fields, drafter="none", cache_prompt=False)))[0]
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        answers = []
        for _ in range(2):
            job = worker.submit(engine.prepare(GenerationRequest(**fields, drafter="mtp", num_draft_tokens=2)))
            answers.append(collect(job.results()))
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
    (first, _, cold), (tokens, _, warm) = answers
    assert cold.stats.cached_tokens == 0 and warm.stats.cached_tokens > KEEP_PREFILL_TOKENS
    assert first == tokens == expected and warm.stats.drafted > 0
    if engine.trimmable:
        assert (warm.stats.drafted, warm.stats.accepted) == (cold.stats.drafted, cold.stats.accepted)


@pytest.mark.parametrize(
    "grammar", ['{"regex": "(for|while) [a-z]{2,8}( [a-z]{2,8}){0,3}\\\\."}', '{"json_object": true}']
)
def test_under_a_grammar_greedy_equals_plain(trained, grammar):
    """Constrained rounds: forced tokens go in as certain drafts, the MTP layer's drafts are cut at the first one the
    grammar forbids; the hidden states of every kept position still reach the layer."""
    engine = trained[0]
    fields = dict(prompt=PROMPT, max_tokens=48, cache_prompt=False, grammar=grammar)
    expected = collect(engine.generate(GenerationRequest(**fields, drafter="none")))[0]
    for k in (1, 3):
        tokens, _, last = collect(engine.generate(GenerationRequest(**fields, drafter="mtp", num_draft_tokens=k)))
        assert tokens == expected and last.stats.drafter == "mtp" and last.stats.drafted > 0


def test_batched_requests_equal_their_answers_alone(trained):
    """Requests decoded together run through the target's batch, not through their HiddenModel: the layer misses
    those positions (drafts get worse), the output does not change."""
    engine, plain = trained
    prompts = [PROMPT, "A class definition defines a class object", PROMPT]
    batched, alone = batched_and_alone(engine, prompts, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False)
    assert alone[0] == plain and batched == alone


def test_a_long_generation_releases_the_pool_as_it_crosses_256(trained):
    """The release rule with the MTP layer drafting (drafts kept: rounds of several tokens): a release in the round
    that crosses 256 generated tokens, the output the target's."""
    engine = trained[0]
    fields = dict(prompt=PROMPT, max_tokens=280, ignore_eos=True, cache_prompt=False)
    plain = collect(engine.generate(GenerationRequest(**fields, drafter="none")))[0]
    tokens, _, last = collect(engine.generate(GenerationRequest(**fields, drafter="mtp", num_draft_tokens=3)))
    assert tokens == plain
    assert last.stats.accepted > 0 and last.stats.releases >= 1
    assert 256 <= last.stats.release_positions[0] < 256 + 4
