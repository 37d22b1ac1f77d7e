"""Sampled speculative decoding: reproducible with a seed, and distributed like the target."""

import mlx.core as mx
import numpy as np
import pytest

from runner.engine import GenerationRequest
from runner.sampling import SamplingParams, filtered_probs, verify_sampled
from tests.helpers import collect

PROMPT = "A class definition defines a class object"


def sampled(engine, seed, k=3, **kw):
    return collect(
        engine.generate(
            GenerationRequest(
                prompt=PROMPT,
                max_tokens=80,
                temperature=0.9,
                top_k=50,
                top_p=0.95,
                seed=seed,
                num_draft_tokens=k,
                ignore_eos=True,
                **kw,
            )
        )
    )


def test_seeded_request_is_reproducible(engine):
    first, text, last = sampled(engine, seed=1234)
    again, text_again, _ = sampled(engine, seed=1234)
    assert first == again and text == text_again
    assert last.stats.drafted > 0


def test_different_seeds_give_different_samples(engine):
    outputs = {tuple(sampled(engine, seed=s)[0]) for s in range(4)}
    assert len(outputs) > 1


def test_sampling_differs_from_greedy(engine):
    greedy = collect(engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=80, ignore_eos=True)))[0]
    assert any(sampled(engine, seed=s)[0] != greedy for s in range(3))


def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# Critical value of chi-square with 5 degrees of freedom at p = 0.001.
CHI2_CRITICAL_DF5 = 20.52


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_sampling_matches_the_target_distribution(k):
    """On a 6-token vocabulary the first emitted token of a round follows p, not q."""
    vocab, trials = 6, 6000
    rng = np.random.default_rng(7)
    p = mx.array(rng.dirichlet(np.ones(vocab), size=k + 1).astype(np.float32))
    q = mx.array(rng.dirichlet(np.ones(vocab), size=k).astype(np.float32))
    key = mx.random.key(11)
    counts = np.zeros(vocab)
    accepted_any = 0
    for _ in range(trials):
        key, draft_key, verify_key = mx.random.split(key, 3)
        drafts = mx.random.categorical(mx.log(q), axis=-1, key=draft_key)
        verdict = verify_sampled(p, q, drafts, verify_key)
        accepted = verdict.accepted.item()
        first = drafts[0].item() if accepted > 0 else verdict.next_token.item()
        counts[first] += 1
        accepted_any += accepted > 0
    target = np.array(p[0])
    assert chi_square(counts, target) < CHI2_CRITICAL_DF5
    draft = np.array(q[0])
    assert chi_square(counts, draft) > CHI2_CRITICAL_DF5  # the test can tell p from q
    assert 0 < accepted_any < trials


def test_bonus_token_follows_the_last_target_distribution():
    vocab, trials = 6, 4000
    rng = np.random.default_rng(3)
    p = mx.array(rng.dirichlet(np.ones(vocab), size=2).astype(np.float32))
    q = p[:1]  # draft == target: every draft is accepted, the bonus comes from p[1]
    key = mx.random.key(5)
    counts = np.zeros(vocab)
    for _ in range(trials):
        key, draft_key, verify_key = mx.random.split(key, 3)
        drafts = mx.random.categorical(mx.log(q), axis=-1, key=draft_key)
        verdict = verify_sampled(p, q, drafts, verify_key)
        assert verdict.accepted.item() == 1
        counts[verdict.next_token.item()] += 1
    assert chi_square(counts, np.array(p[1])) < CHI2_CRITICAL_DF5


def test_filters_shape_the_distribution():
    logits = mx.array([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    top2 = np.array(filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2)))[0]
    assert (top2[2:] == 0).all() and top2[:2].sum() == pytest.approx(1.0)
    nucleus = np.array(filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.5)))[0]
    assert nucleus[0] == pytest.approx(1.0)  # the top token alone holds > 0.5
    floor = np.array(filtered_probs(logits, SamplingParams(temperature=1.0, min_p=0.3)))[0]
    assert (floor > 0).sum() == 2  # e^-1 = 0.37 >= 0.3 > e^-2
    hot = np.array(filtered_probs(logits, SamplingParams(temperature=100.0)))[0]
    assert hot.max() - hot.min() < 0.02
