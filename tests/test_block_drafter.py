"""Block drafting (runner/drafting/block.py, ``drafter = "block"``): DFlash's layout, one forward pass per proposal.

On the drafters models/train_block.py (``make block-model``) trains for SmolLM2 and the default pair's target, and
its random-weight stand-in for a published DFlash checkpoint (``dflash_random``, over the default target). Greedy
output equals plain decoding at every depth up to the block's and with the adaptive depth; the trained drafters'
drafts are kept often enough to matter; grammars, batches, prompt-cache hits, the memory estimate and a runner
started by the supervisor work with it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.defaults import DEFAULT_TARGET, SMOLLM2_DIR
from common.requests import InvalidRequest
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from tests.helpers import batched_and_alone, collect

BLOCK_DIR = Path(__file__).resolve().parents[1] / "models" / "block"
PROMPT = "The while statement is used for repeated execution as long as an expression is true"
TOKENS = 32
TARGETS = {"smollm2": SMOLLM2_DIR, "default": DEFAULT_TARGET}
# Measured on the committed training (make block-model): greedy drafts kept at k = 3 over PROMPT, 0.32 on the
# default target; the floor leaves a margin. SmolLM2's drafter keeps almost none (held out: 0.09 of first drafts;
# docs/benchmarks.md#block): not asserted there.
KEPT_FLOOR = 0.2

pytestmark = pytest.mark.skipif(not (BLOCK_DIR / "smollm2").is_dir(), reason="make block-model")


def generate(engine, **fields):
    fields = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "cache_prompt": False, **fields}
    tokens, _, last = collect(engine.generate(GenerationRequest(**fields)))
    return tokens, last.stats


@pytest.fixture(scope="module")
def engines():
    """name -> (engine, its plain greedy answer) of a target with its trained block drafter, each loaded once."""
    loaded = {}

    def get(name: str):
        if name not in loaded:
            engine = Engine.load(
                TARGETS[name], settings=RunnerSettings(dtype="float32", block=BLOCK_DIR / name, prompt_cache=0)
            )
            loaded[name] = engine, generate(engine, drafter="none")[0]
        return loaded[name]

    return get


@pytest.fixture(scope="module", params=list(TARGETS))
def block(request, engines):
    """Each target with its trained block drafter."""
    return engines(request.param)


@pytest.fixture(scope="module")
def default_block(engines):
    """The default target with its trained block drafter: what one target's check needs (quick)."""
    return engines("default")


def test_it_loads_and_drafts_by_default(block):
    engine, _ = block
    assert engine.drafters["block"] == "" and engine.default_drafter == "block"
    assert "block drafter" in engine.speculative_note
    assert engine.depth["block"].one_pass and engine.depth["block"].max_depth == engine.block.config.block_size - 1


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_at_each_depth_up_to_the_block_equals_plain(block, k):
    engine, plain = block
    tokens, stats = generate(engine, drafter="block", num_draft_tokens=k)
    assert tokens == plain
    assert stats.drafter == "block" and stats.drafted > 0 and max(stats.depths) <= k


def test_greedy_with_the_adaptive_depth_equals_plain(block):
    engine, plain = block
    tokens, stats = generate(engine, drafter="block")
    assert tokens == plain and stats.drafter == "block"


def test_its_drafts_are_kept(default_block):
    """A trained drafter's drafts are kept often enough to matter (what a random one never does)."""
    engine, _ = default_block
    _, stats = generate(engine, drafter="block", num_draft_tokens=3)
    assert stats.accepted >= KEPT_FLOOR * stats.drafted
    assert stats.rounds < TOKENS  # rounds that kept drafts emitted several tokens


def test_seeded_sampling_repeats(block):
    engine, _ = block
    fields = dict(drafter="block", num_draft_tokens=3, temperature=0.8, seed=5)
    tokens, stats = generate(engine, **fields)
    assert len(tokens) == TOKENS and generate(engine, **fields)[0] == tokens and stats.drafted > 0


def test_one_forward_pass_per_proposal(block, monkeypatch):
    """A draft of depth k is one pass of the block model, whatever k."""
    from runner.drafting.block import BlockDrafter, BlockDraftModel

    engine, _ = block
    passes, proposals = [], []
    call, propose = BlockDraftModel.__call__, BlockDrafter.propose

    def counting_call(self, *args, **kwargs):
        passes.append(1)
        return call(self, *args, **kwargs)

    def counting_propose(self, context, k, params, key):
        proposal = propose(self, context, k, params, key)
        if proposal is not None:
            proposals.append(proposal.size)
        return proposal

    monkeypatch.setattr(BlockDraftModel, "__call__", counting_call)
    monkeypatch.setattr(BlockDrafter, "propose", counting_propose)
    generate(engine, drafter="block", num_draft_tokens=5)
    assert proposals and max(proposals) == 5
    assert len(passes) == len(proposals)


def test_after_a_prompt_cache_hit_it_drafts_from_what_the_target_runs(block):
    engine, plain = block
    fields = dict(drafter="block", num_draft_tokens=3, cache_prompt=True)
    cache = engine.prompt_cache
    engine.prompt_cache = type(cache)(64 << 20)
    try:
        generate(engine, **fields)
        tokens, stats = generate(engine, **fields)
    finally:
        engine.prompt_cache = cache
    assert stats.cached_tokens > 0
    assert tokens == plain and stats.drafted > 0 and stats.accepted > 0


@pytest.mark.parametrize(
    "grammar", ['{"regex": "(for|while) [a-z]{2,8}( [a-z]{2,8}){0,3}\\\\."}', '{"json_object": true}']
)
def test_under_a_grammar_greedy_equals_plain(block, grammar):
    """Forced tokens go in as certain drafts, the block's drafts are cut at the first one the grammar forbids."""
    engine, _ = block
    fields = dict(max_tokens=40, ignore_eos=False, grammar=grammar)
    expected = generate(engine, drafter="none", **fields)[0]
    for k in (1, 4):
        tokens, stats = generate(engine, drafter="block", num_draft_tokens=k, **fields)
        assert tokens == expected and stats.drafter == "block"


def test_batched_requests_equal_their_answers_alone(block):
    """Rows decoded together run through the target's batch, not through TappedModel: the drafter misses those
    positions, the output does not change."""
    engine, plain = block
    prompts = [PROMPT, "A class definition defines a class object", PROMPT]
    batched, alone = batched_and_alone(engine, prompts, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False)
    assert alone[0] == plain and batched == alone


def test_a_long_generation_releases_the_pool_as_it_crosses_256(default_block):
    """The release rule with the block drafter: a release in the round that crosses 256 generated tokens."""
    engine, _ = default_block
    plain = generate(engine, drafter="none", max_tokens=280)[0]
    tokens, stats = generate(engine, drafter="block", num_draft_tokens=4, max_tokens=280)
    assert tokens == plain
    assert stats.drafted > 0 and stats.releases >= 1
    assert 256 <= stats.release_positions[0] < 256 + 1 + 4


def test_the_memory_estimate_counts_it(block):
    import dataclasses

    from common.footprint import ModelFootprint, estimate
    from supervisor.config import ModelConfig
    from supervisor.memory import Estimates

    engine, _ = block
    settings = dataclasses.replace(engine.settings, target=engine.target.path)
    with_block = Estimates().footprints(ModelConfig("m", settings))
    without = Estimates().footprints(ModelConfig("m", RunnerSettings(target=engine.target.path)))
    assert len(with_block) == len(without) + 1
    assert with_block[-1].parameters == ModelFootprint.of(settings.block).parameters > 0
    assert estimate(with_block, "float32", "cpu").total > estimate(without, "float32", "cpu").total


def test_a_folder_for_another_target_or_none_is_refused_with_the_reason(tmp_path):
    engine = Engine.load(DEFAULT_TARGET, settings=RunnerSettings(block=BLOCK_DIR / "smollm2", prompt_cache=0))
    assert "trained for another target" in engine.drafters["block"]
    assert engine.default_drafter == "none" and "trained for another target" in engine.speculative_note
    with pytest.raises(InvalidRequest, match="'block' is not available: .*trained for another target"):
        generate(engine, drafter="block")
    missing = Engine.load(DEFAULT_TARGET, settings=RunnerSettings(block=tmp_path / "nothing", prompt_cache=0))
    assert "has no config.json" in missing.drafters["block"] and missing.default_drafter == "none"
    plain = Engine.load(DEFAULT_TARGET, settings=RunnerSettings(prompt_cache=0))
    assert "no block drafter" in plain.drafters["block"] and plain.default_drafter == "ngram"


def test_the_published_layout_is_checked_by_shape(engines):
    """A folder without a record of its target (the published layout, for the default target) is refused where its
    shapes do not fit: SmolLM2's."""
    from runner.drafting.block import BlockError, load_block

    engine, _ = engines("smollm2")
    with pytest.raises(BlockError, match="width 384"):
        load_block(BLOCK_DIR / "dflash_random", engine.target)


def test_the_published_layout_loads_and_drafts():
    """z-lab's DFlash layout (random weights, no record of its target): loaded, drafts, greedy equals plain."""
    engine = Engine.load(
        DEFAULT_TARGET,
        settings=RunnerSettings(dtype="float32", block=BLOCK_DIR / "dflash_random", prompt_cache=0),
    )
    assert engine.drafters["block"] == "" and engine.block.config.target is None
    assert engine.block.config.target_layer_ids == (1, 4, 7) and engine.block.config.block_size == 8
    plain = generate(engine, drafter="none")[0]
    for k in (2, 7):
        tokens, stats = generate(engine, drafter="block", num_draft_tokens=k)
        assert tokens == plain and stats.drafted > 0


def test_a_runner_with_the_block_drafter_answers_through_the_supervisor(default_block, tmp_path_factory):
    from tests.processes import SupervisorProcess, model_toml

    engine, plain = default_block
    models = model_toml("blk", draft=None, drafter="block", block=str(BLOCK_DIR / "default"), dtype="float32")
    sup = SupervisorProcess(tmp_path_factory.mktemp("block-sup"), models).wait_ready(120)
    try:
        answer = sup.openai().completions.create(model="blk", prompt=PROMPT, max_tokens=TOKENS, temperature=0)
        extra = answer.model_extra["x_mlxserve"]
        assert extra["drafter"] == "block" and extra["drafted"] > 0
        assert answer.choices[0].text == engine.tokenizer.decode(plain)
    finally:
        assert sup.stop() == 0
