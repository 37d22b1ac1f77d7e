"""Speculation: both drafters, fixed and adaptive depth, pipelined plain decoding, rewinding recurrent layers.

Greedy output must equal plain greedy in every configuration; sampled output
must follow the target's distribution whatever drafts it.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

from common.defaults import DEFAULT_DRAFT, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.decoders import PlainDecoder, SpeculativeDecoder
from runner.drafting.depth import SMOOTHING, DepthController, FixedDepth
from runner.drafting.drafters import NgramDrafter
from runner.engine import Engine
from runner.prefill import PrefillPlanner
from runner.request import GenerationRequest
from runner.sampling import SamplingParams, point_mass, verify_sampled
from tests.helpers import collect, queued_and_not, tiny_hybrid_model, tiny_sliding_window_model
from tests.test_engine_sampling import CHI2_CRITICAL_DF5, chi_square

PROSE = "The for statement is used to iterate over the elements of a sequence"
# Input-grounded: the answer copies from the prompt.
GROUNDED = (
    "Repeat this list, in the same order:\n- for statements iterate over sequences\n"
    "- while statements repeat while a condition holds\n- break leaves the loop\n"
    "- continue goes on with the next iteration\nThe list again:\n- for statements"
)
TOKENS = 300


def greedy(engine, prompt, **fields):
    tokens, _, last = collect(
        engine.generate(
            GenerationRequest(prompt=prompt, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False, **fields)
        )
    )
    return tokens, last.stats


@pytest.fixture(scope="module")
def plain(engine):
    return {prompt: greedy(engine, prompt, drafter="none")[0] for prompt in (PROSE, GROUNDED)}


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_with_a_fixed_depth_equals_plain(engine, plain, drafter, k):
    for prompt, expected in plain.items():
        tokens, stats = greedy(engine, prompt, drafter=drafter, num_draft_tokens=k)
        assert tokens == expected
        assert stats.drafter == drafter and max(stats.depths) <= k
    assert stats.drafted > 0  # the grounded prompt always gives the n-gram drafter something


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_with_the_adaptive_depth_equals_plain(engine, plain, drafter):
    depths = set()
    for prompt, expected in plain.items():
        tokens, stats = greedy(engine, prompt, drafter=drafter)
        assert tokens == expected
        assert sum(stats.depths.values()) == stats.rounds and stats.drafted == sum(
            depth * rounds for depth, rounds in stats.depths.items()
        )
        depths |= set(stats.depths)
    assert len(depths) >= 2  # it drafted at some depth, and ran plain rounds (on prose, n-gram may never draft)


@pytest.mark.parametrize("k", [1, 3])
def test_a_first_draft_queued_with_the_verification_is_the_draft_it_would_have_made(engine, plain, k, monkeypatch):
    """The draft model queues the next round's first draft, for every outcome, before the verdict is read
    (ModelDrafter.queue_next): the same drafts, so the same output and the same drafts kept, as drafting when asked."""
    from runner.drafting.drafters import ModelDrafter

    runs = queued_and_not(
        monkeypatch,
        ModelDrafter,
        lambda: [greedy(engine, prompt, drafter="model", num_draft_tokens=k) for prompt in (PROSE, GROUNDED)],
    )
    (queued, used), (unqueued, unused) = runs[True], runs[False]
    assert [tokens for tokens, _ in queued] == [tokens for tokens, _ in unqueued] == list(plain.values())
    assert [(s.drafted, s.accepted) for _, s in queued] == [(s.drafted, s.accepted) for _, s in unqueued]
    rounds = sum(s.rounds for _, s in queued)
    assert unused == 0 and used >= rounds - 4, (used, rounds)  # every round but each request's first


@pytest.mark.parametrize("accepted", [0, 1, 2])
def test_a_queued_sampled_draft_carries_the_distribution_a_proposal_would_have(engine, accepted):
    """Sampling: the first draft the draft model queues with a verification (ModelDrafter.queue_next), for the
    outcome the verdict gives, is drawn from - and hands the verifier - the distribution a proposal made afresh
    after the same context has: were the rows mixed up, speculative sampling would no longer keep the target's
    distribution, which its output would not show."""
    from runner.drafting.drafters import ModelDrafter
    from runner.sampling import SamplingParams, Verdict

    params = SamplingParams(temperature=0.8)
    context = engine.tokenizer.encode(PROSE)
    queued = ModelDrafter(engine.draft.model)
    proposal = queued.propose(context, 2, params, mx.random.key(1))
    drafts = proposal.tokens.tolist()
    chosen = 7  # the target's token after the kept drafts (any token: the verdict is the caller's)
    verdict = Verdict(mx.array(accepted), mx.array(chosen, dtype=mx.uint32))
    queued.queue_next(context, proposal.tokens, verdict, params, mx.random.key(2))
    queued.accepted(proposal, accepted)
    after = context + drafts[:accepted] + [chosen]
    fresh = ModelDrafter(engine.draft.model).propose(after, 1, params, mx.random.key(3))
    next_proposal = queued.propose(after, 1, params, mx.random.key(4))
    assert queued._next is None and queued.held == len(after)  # it took the queued draft
    assert mx.allclose(next_proposal.probs[0], fresh.probs[0], atol=1e-5).item()
    assert next_proposal.probs[0][next_proposal.tokens[0]].item() > 0  # drawn from that distribution


def test_a_round_left_no_room_to_draft_is_a_plain_round(engine):
    """A round that reads the token a plain round queued, with the budget's last token, drafts nothing: the depth
    controller records a plain round, not one of depth -1 (min(k, budget - 1) with no budget left)."""
    for tokens in range(2, 40):
        request = GenerationRequest(
            prompt="Repeat: a b c d e f g h. Again: a b c", max_tokens=tokens, drafter="ngram", ignore_eos=True
        )
        _, _, last = collect(engine.generate(request))
        assert last.stats.generated_tokens == tokens
    assert min(engine.depth["ngram"].histogram) >= 0, engine.depth["ngram"].histogram


@pytest.mark.parametrize("k", [0, 1])
def test_the_plain_rounds_of_a_speculative_decoder_equal_plain_decoding(engine, plain, k):
    """PlainDecoder queues each next forward pass before reading a token. A speculative decoder does the same
    in its rounds of depth 0 and while the n-gram drafter is not ready; a round that looks a token up and
    finds nothing reads it first and queues after; a round with a proposal verifies it. At k = 1 on prose
    the n-gram drafter gives every kind of round."""
    ids = engine.tokenizer.encode(PROSE)
    params = SamplingParams()
    results = []
    for decoder in (
        PlainDecoder(engine.target.model, ids, params, mx.random.key(0)),
        SpeculativeDecoder(engine.target.model, ids, params, mx.random.key(0), NgramDrafter(ids), FixedDepth(k)),
    ):
        planner = PrefillPlanner(heads=6)
        while not decoder.prefill_step(planner):
            pass
        tokens = []
        while len(tokens) < TOKENS:
            tokens += decoder.step(TOKENS - len(tokens)).tokens
        results.append(tokens)
    assert results[0] == results[1] == plain[PROSE]
    if k:
        assert decoder.stats.depths[0] > 0 and decoder.stats.depths[1] > 0


def test_the_ngram_drafter_is_ready_when_the_context_end_occurred_before():
    drafter = NgramDrafter([1, 2, 3, 9, 1, 2], n_max=3, n_min=2)
    assert drafter.ready()  # "1 2" came before: the output is copying
    drafter.extend([8])
    assert not drafter.ready()  # "2 8" did not
    drafter.extend([1, 2, 3])
    assert drafter.ready()


def test_ngram_lookup_takes_the_longest_most_recent_match():
    drafter = NgramDrafter([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3], n_max=3, n_min=1)
    assert drafter.lookup(3) == [4, 5, 7]  # "2 3" last followed by 4 (the later of two matches)
    drafter.extend([8])
    assert drafter.lookup(2) == []  # 8 never came before
    drafter.extend([1, 2, 3])
    assert drafter.lookup(4) == [4, 5, 7, 2]  # "1 2 3" (n = 3) beats shorter matches
    assert NgramDrafter([5, 6], n_max=4, n_min=2).lookup(3) == []


@pytest.mark.parametrize("k", [1, 3])
def test_ngram_proposals_keep_the_target_distribution(k):
    """A point-mass proposal is kept with probability p(token), else replaced from p without it."""
    vocab, trials = 6, 6000
    rng = np.random.default_rng(17)
    p = mx.array(rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32))
    drafts = mx.array([2, 4, 1][:k], dtype=mx.uint32)
    q = point_mass(drafts, vocab)
    key = mx.random.key(23)
    counts = np.zeros(vocab)
    for _ in range(trials):
        key, verify_key = mx.random.split(key)
        verdict = verify_sampled(p, q, drafts, verify_key)
        accepted = verdict.accepted.item()
        counts[drafts[0].item() if accepted > 0 else verdict.next_token.item()] += 1
    assert chi_square(counts, np.array(p[0])) < CHI2_CRITICAL_DF5
    assert 0 < counts[2] < 0.9 * trials  # not the point mass: the drafted token is kept only as often as p says


def test_depth_controller_goes_deep_when_drafts_are_kept_and_plain_when_they_are_not():
    keeps = DepthController(max_depth=6, probe_every=4)
    for _ in range(200):
        k = keeps.choose()
        keeps.record(k, k, 0.010 + 0.001 * k)  # every draft kept, drafts nearly free
    assert keeps.best() >= 5
    never = DepthController(max_depth=6, probe_every=4)
    for _ in range(200):
        k = never.choose()
        never.record(k, 0, 0.010 + 0.004 * k)  # every draft rejected
    assert never.best() == 0 and never.interval == 4  # from plain decoding it keeps probing at the base rate
    assert never.histogram[1] > 0
    assert never.histogram[0] > 0.7 * sum(never.histogram.values())


def steady(controller, rounds, seconds, acceptance, rng, spikes=0.0):
    """Run ``controller`` for ``rounds`` rounds: a round of depth k takes ``seconds[k]`` (within 10%, and 4x as
    long with chance ``spikes``), each draft kept with chance ``acceptance`` while the ones before it were."""
    for _ in range(rounds):
        k = controller.choose()
        kept = 0
        while kept < k and rng.random() < acceptance:
            kept += 1
        took = seconds[k] * rng.uniform(0.9, 1.1) * (4 if rng.random() < spikes else 1)
        controller.record(k, kept, took)


def test_depth_controller_probes_less_while_the_best_depth_keeps_winning():
    rng = random.Random(1)
    seconds = {0: 0.016, 1: 0.012, 2: 0.019, 3: 0.024, 4: 0.03, 5: 0.036, 6: 0.042}  # k = 1 is clearly best
    controller = DepthController(max_depth=6, probe_every=10, max_probe_every=80)
    steady(controller, 2000, seconds, 0.75, rng)
    assert controller.best() == 1 and controller.interval == 80
    assert controller.histogram[1] > 0.97 * 2000  # at a fixed interval of 10 it would be ~0.9
    # Drafts become nearly free and always kept: it finds the deeper depths again, at the base interval.
    cheap = {k: 0.012 + 0.0005 * k for k in range(7)}
    steady(controller, 600, cheap, 1.0, rng)
    assert controller.best() >= 4


def test_depth_controller_climbs_while_drafts_are_kept_without_waiting_for_probes():
    """Copying from the input: n-gram drafts nearly all kept, a deeper verification costs little. SmolLM2 did this
    and the controller kept k = 1 (it waited for probes, which back off); k = 4 was 1.3x faster."""
    controller = DepthController(max_depth=6, probe_every=1000, max_probe_every=1000)  # no probe in this run
    seconds = {0: 0.040, **{k: 0.050 + 0.002 * k for k in range(1, 7)}}
    steady(controller, 40, seconds, 0.95, random.Random(3))
    assert controller.best() >= 4 and sum(controller.histogram[k] for k in range(4, 7)) > 10
    # Drafts stop being kept: it comes back down, to plain decoding.
    steady(controller, 60, seconds, 0.0, random.Random(4))
    assert controller.best() == 0


def test_a_one_pass_drafter_climbs_where_its_deeper_drafts_cost_no_more_passes():
    """A block drafter (runner.drafting.block) drafts any depth in one pass: a drafted round costs that pass plus a
    verification that grows a little with k; plain rounds pay neither. The line through k = 0 and k = 1 takes the
    draft pass for a cost per draft, and the controller climbs only as probes find out; told the cost shape, it
    expects the deeper rounds to cost what k = 1 does and climbs at once (seeds 0-9, first 60 rounds: 44.3 vs
    47.7 rounds at k >= 4 on average; 40.4 vs 47.5 before it probed only neighbours that could win, 26.9 vs 48.0
    before it took the deepest of near-equal depths)."""
    seconds = {0: 0.040, **{k: 0.055 + 0.001 * k for k in range(1, 7)}}
    deep = {}
    for one_pass in (False, True):
        deep[one_pass] = 0
        for seed in range(10):
            controller = DepthController(max_depth=6, one_pass=one_pass)
            assert controller.for_request().one_pass == one_pass
            steady(controller, 60, seconds, 0.7, random.Random(seed))
            deep[one_pass] += sum(controller.histogram[k] for k in range(4, 7))
    assert deep[True] > 400 and deep[True] > 1.05 * deep[False]


def test_a_neighbour_that_could_not_win_is_not_probed():
    """On the EPYC (2026-12-07) k = 1 on the pair was 1.4x plain decoding at 80% acceptance, and a probe of plain
    decoding cost three rounds that restart the pipeline, every other probe: it is not tried while its expected rate
    is more than PROBE_SLACK behind. When acceptance falls so that plain decoding could win, it is probed again."""
    seconds = {0: 0.0052, 1: 0.0064, 2: 0.0097, 3: 0.0119, 4: 0.0137, 5: 0.0142, 6: 0.0151}  # the pair's, measured
    controller = DepthController(max_depth=6, probe_every=10, max_probe_every=80)
    controller.seconds.update(seconds)
    controller.profile = [0.8] * 6  # what the runner's requests kept
    steady(controller, 400, seconds, 0.8, random.Random(2))
    assert controller.best() == 1 and controller.histogram[0] == 0 and controller.histogram[2] > 0
    steady(controller, 400, seconds, 0.3, random.Random(3))  # k = 1 now 1.0x plain decoding
    assert controller.histogram[0] > 0


def test_a_deeper_depth_is_expected_to_take_at_least_as_long_as_a_shallower_one():
    """A drafted round does the work of every shallower one and more; a median saying otherwise is old or lucky
    (the pair's head on the EPYC: k = 4 at 12.8 ms, k = 3 at 17.1, and requests went to k = 4)."""
    controller = DepthController(max_depth=6)
    controller.seconds.update({0: 0.0052, 1: 0.0061, 2: 0.0134, 3: 0.0171, 4: 0.0128})
    assert controller.predicted_seconds(4) == pytest.approx(0.0171)
    assert controller.predicted_seconds(5) >= 0.0171
    assert controller.predicted_seconds(0) == pytest.approx(0.0052)  # plain rounds do other work (pipelined)
    controller.profile = [0.95] * 6
    assert controller.best() != 4


def test_a_run_of_rejected_drafts_does_not_hold_a_request_at_plain_decoding():
    """Acceptance comes in runs: ten rejected drafts in a row drop a request that usually keeps ~75% to plain
    decoding, where it sees no drafts. What they said fades toward the runner's typical request as plain rounds go
    by, so it drafts again without waiting for a probe to be kept (none runs here): within about twice the
    rounds the counts remember (1 / SMOOTHING)."""
    seconds = {0: 0.0078, **{k: 0.0098 + 0.0025 * k for k in range(1, 7)}}  # the default pair's, measured
    runner = DepthController(max_depth=6, probe_every=1000, max_probe_every=1000)
    runner.profile = [0.75, 0.85, 0.85, 0.85, 0.85, 0.85]
    request = runner.for_request()
    for k, t in seconds.items():
        request.record(k, k if k else 0, t)
    for _ in range(10):  # a hard stretch: every draft rejected
        request.record(1, 0, seconds[1])
    assert request.best() == 0
    plain = 0
    while request.choose() == 0 and plain < 100:
        request.record(0, 0, seconds[0])
        plain += 1
    assert plain < 3 / SMOOTHING


def test_of_depths_about_as_fast_it_takes_the_deepest():
    """Within MARGIN of the fastest, the deeper depth: its rounds keep the deeper positions' acceptance current;
    a depth clearly slower is not taken."""
    controller = DepthController(max_depth=3)
    controller.profile = [0.8] * 3
    expected = [controller.expected_tokens(k) for k in range(4)]
    for rates, best in (((100, 101, 102, 100.5), 3), ((100, 101, 104, 100.5), 2)):  # tokens per second at k = 0..3
        controller.seconds = {k: expected[k] / rate for k, rate in enumerate(rates)}
        assert controller.best() == best


def test_each_request_learns_its_own_acceptance_and_shares_the_round_times():
    """Copying is a property of the request: one that copies does not make the next one start as if it did."""
    rng = random.Random(5)
    seconds = {0: 0.040, **{k: 0.050 + 0.002 * k for k in range(1, 7)}}
    runner = DepthController(max_depth=6)
    for _ in range(3):  # prose: a draft now and then
        request = runner.for_request()
        steady(request, 40, seconds, 0.2, rng)
        request.finish()
    prose = runner.acceptance[0]
    copying = runner.for_request()
    assert copying.acceptance == runner.acceptance and copying.seconds is runner.seconds
    steady(copying, 60, seconds, 0.95, rng)
    assert copying.best() >= 4 and copying.acceptance[0] > 0.85  # 0.95 kept, one round of prose prior
    assert runner.acceptance[0] == prose  # the runner's starting point moves when the request ends, not per round
    copying.finish()
    # A quarter of the way from what the earlier requests kept to what this one kept (the share of its rounds).
    kept = copying.kept_in_all[0] / copying.reached[0]
    assert kept > 0.85 and runner.acceptance[0] == pytest.approx(prose + 0.25 * (kept - prose))
    assert copying.acceptance[0] - runner.acceptance[0] > 0.3  # the next request starts nearer prose than copying


def test_a_request_that_keeps_every_shallow_draft_expects_the_deeper_ones_kept():
    """Acceptance comes in runs: a request copying its input at depth 2 expects depth 4 to keep as much, whatever
    probes of earlier prose requests saw at those positions. SmolLM2 copying a list stayed at k = 2 (the deep
    positions held at what prose had kept) where k = 4 was 1.1x faster."""
    runner = DepthController(max_depth=6, probe_every=1000, max_probe_every=1000)
    seconds = {0: 0.057, 1: 0.080, 2: 0.076, 3: 0.108, 4: 0.115, 5: 0.130}  # SmolLM2's, measured
    prose = runner.for_request()
    for k in (4, 3, 4, 5, 2, 2, 2):  # probes that kept little
        prose.record(k, 0, seconds[k])
    prose.finish()
    copying = runner.for_request()
    for _ in range(4):
        copying.record(2, 2, seconds[2])
    assert copying.acceptance[3] > 0.8
    assert copying.best() >= 4


def test_a_request_times_the_starting_depth_when_the_runner_has_timed_only_plain_rounds():
    """Earlier requests ran plain (batched, or with drafting off): the next request still tries drafting."""
    runner = DepthController(max_depth=6, start=1)
    earlier = runner.for_request()
    for _ in range(5):
        earlier.record(0, 0, 0.004)
    assert runner.seconds == {0: 0.004} and runner.best() == 0
    request = runner.for_request()
    assert 1 in [request.choose() for _ in range(3)]


def test_depth_controller_is_not_thrown_by_late_rounds():
    """On a shared machine some rounds run late; they must not make the best depth look slow for long."""
    rng = random.Random(2)
    seconds = {0: 0.016, 1: 0.012, 2: 0.019, 3: 0.024, 4: 0.03, 5: 0.036, 6: 0.042}
    controller = DepthController(max_depth=6)
    steady(controller, 2000, seconds, 0.75, rng, spikes=0.05)
    assert controller.histogram[1] > 0.9 * 2000


def test_depth_controller_does_not_time_an_untimed_round():
    controller = DepthController(max_depth=6)
    controller.record(1, 1, None)  # a request's first round: acceptance counts, its time does not
    assert controller.seconds == {} and controller.acceptance[0] > 0.5 and controller.histogram[1] == 1
    controller.record(1, 0, 0.01)
    assert controller.seconds == {1: 0.01}


def test_sampled_speculation_with_ngram_is_reproducible_with_a_seed(engine):
    def sample(seed):
        return collect(
            engine.generate(
                GenerationRequest(
                    prompt=GROUNDED,
                    max_tokens=60,
                    temperature=0.8,
                    seed=seed,
                    drafter="ngram",
                    ignore_eos=True,
                    cache_prompt=False,
                )
            )
        )[0]

    assert sample(5) == sample(5)
    assert any(sample(s) != sample(5) for s in (6, 7))


# -- models whose caches cannot be trimmed ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    folder = tiny_hybrid_model(tmp_path_factory.mktemp("hybrid") / "lfm2")
    return Engine.load(folder, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))


@pytest.mark.parametrize(
    "fields",
    [
        dict(drafter="model", num_draft_tokens=1),
        dict(drafter="model", num_draft_tokens=4),
        dict(drafter="model"),
        dict(drafter="ngram", num_draft_tokens=3),
    ],
)
def test_hybrid_model_speculates_by_restoring_its_recurrent_state(hybrid, fields):
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    assert hybrid.speculative and hybrid.target.rewindable
    assert not can_trim_prompt_cache(
        make_prompt_cache(hybrid.target.model)
    )  # ArraysCache layers: restored, not trimmed
    expected, _ = greedy(hybrid, GROUNDED, drafter="none")
    tokens, stats = greedy(hybrid, GROUNDED, **fields)
    assert tokens == expected
    assert stats.drafted > 0 and stats.accepted < stats.drafted  # rejections happened, and were rewound


def test_smollm2_ngram_drafting_on_a_grounded_prompt_equals_plain():
    engine = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0))
    assert engine.default_drafter == "ngram"
    messages = (
        (
            "user",
            GROUNDED.removesuffix("The list again:\n- for statements")
            + "Now repeat the list exactly, one item a line.",
        ),
    )

    def run(**f):
        return collect(engine.generate(GenerationRequest(messages=messages, max_tokens=60, cache_prompt=False, **f)))

    expected, _, _ = run(drafter="none")
    tokens, _, last = run()  # the default: n-gram lookup, adaptive depth (its choices depend on timing)
    assert tokens == expected and last.stats.drafter == "ngram"
    tokens, _, last = run(num_draft_tokens=2)  # a pinned depth drafts the same way on any machine
    assert tokens == expected
    assert last.stats.accepted >= 5  # the list is copied from the prompt


def test_a_full_sliding_window_is_rewound_after_one_token_steps(tmp_path):
    """A draft model steps one token at a time, and a full window (RotatingKVCache) writes those in place, over
    its oldest tokens: the Rewinder's kept state must survive the writes. Rewound to one kept token, the cache
    gives the same next logits as a cache that only ever saw that token."""
    from mlx_lm import load
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from runner.rewind import Rewinder

    model, _ = load(str(tiny_sliding_window_model(tmp_path / "sliding")))
    model.set_dtype(mx.float32)
    prompt = [(7 * i) % 4000 + 5 for i in range(100)]  # past the 64-token window
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:-2])[None], cache=cache)
    for token in prompt[-2:]:  # after these the window's buffer is written in place
        model(mx.array([[token]]), cache=cache)
    assert any(isinstance(layer, RotatingKVCache) and not layer.is_trimmable() for layer in cache)
    rewinder = Rewinder(model, cache)
    rewinder.snapshot()
    fed = [11, 12, 13]
    for token in fed:  # one token a step: written in place
        model(mx.array([[token]]), cache=cache)
    rewinder.rewind(fed, 1)
    fresh = make_prompt_cache(model)
    model(mx.array(prompt + fed[:1])[None], cache=fresh)
    got = model(mx.array([[99]]), cache=cache)[0, -1]
    want = model(mx.array([[99]]), cache=fresh)[0, -1]
    assert mx.allclose(got, want, atol=1e-4).item()


def test_a_round_between_plain_decoding_and_drafting_is_not_timed():
    """A plain round after drafted ones restarts the pipeline (on the pair: 9-14 ms against 6-7 ms in a run of
    them); timed, it made plain decoding look slower than it is."""
    controller = DepthController(max_depth=6)
    for k, seconds in [(2, 0.015), (2, 0.015), (0, 0.020), (0, 0.007), (0, 0.007), (2, 0.030), (2, 0.015)]:
        controller.record(k, 1 if k else 0, seconds)
    assert controller.seconds[0] == pytest.approx(0.007) and controller.seconds[2] == pytest.approx(0.015)


def test_a_probe_from_plain_decoding_runs_twice_only_when_its_draft_was_kept():
    times = {0: 0.007, 1: 0.011, 2: 0.014}
    for kept, rounds in ((0, 1), (1, 2)):
        controller = DepthController(max_depth=2, probe_every=5, max_probe_every=5)
        controller.seconds.update(times)
        controller.profile[0] = 0.02  # drafts seldom kept: plain decoding is best
        chosen = []
        for _ in range(6):
            k = controller.choose()
            chosen.append(k)
            controller.record(k, min(k, kept), times[k])
        assert chosen.count(1) == rounds, chosen
