"""Token choice for one speculative round: greedy, or distribution-preserving sampling.

Sampling follows Leviathan et al. / Chen et al.: a drafted token ``d`` drawn
from the draft's distribution ``q`` is kept with probability
``min(1, p(d) / q(d))``; at the first rejection a replacement is drawn from the
normalised residual ``max(0, p - q)``; when every draft is kept a bonus token
is drawn from the target's next distribution. The emitted tokens are then
distributed exactly as if the target had sampled them alone. The same
temperature / top-k / top-p / min-p filters shape both ``p`` and ``q``.

Everything here stays lazy (mx arrays) so a round needs a single evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Probabilities over the last axis after temperature and the filters."""
    logits = logits.astype(mx.float32) / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth_largest = mx.sort(logits, axis=-1)[..., vocab - params.top_k, None]
        logits = mx.where(logits < kth_largest, -mx.inf, logits)
    probs = mx.softmax(logits, axis=-1)
    if params.top_p < 1.0:
        order = mx.argsort(-probs, axis=-1)
        sorted_probs = mx.take_along_axis(probs, order, axis=-1)
        mass_before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < params.top_p  # always keeps the most likely token
        keep = mx.put_along_axis(mx.zeros_like(keep_sorted), order, keep_sorted, axis=-1)
        probs = mx.where(keep, probs, 0.0)
    if params.min_p > 0.0:
        threshold = params.min_p * mx.max(probs, axis=-1, keepdims=True)
        probs = mx.where(probs >= threshold, probs, 0.0)
    return probs / mx.sum(probs, axis=-1, keepdims=True)


def sample(probs: mx.array, key: mx.array) -> mx.array:
    """One token id per row of ``probs``."""
    return mx.random.categorical(mx.log(probs), axis=-1, key=key)


@dataclass
class Verdict:
    """The outcome of verifying one round (lazy until evaluated)."""

    accepted: mx.array  # scalar: how many draft tokens are kept
    next_token: mx.array  # scalar: the target's own token after them


def verify_greedy(target_logits: mx.array, draft_tokens: mx.array) -> Verdict:
    """Keep the drafts while they equal the target's argmax; then the target's argmax.

    ``target_logits`` has k + 1 rows: the target's prediction at the last
    emitted token and after each of the k drafts.
    """
    choices = mx.argmax(target_logits, axis=-1)
    k = draft_tokens.size
    accepted = _leading_true(choices[:k] == draft_tokens)
    return Verdict(accepted, choices[accepted])


def verify_sampled(target_probs: mx.array, draft_probs: mx.array, draft_tokens: mx.array, key: mx.array) -> Verdict:
    """Speculative sampling: rows of ``target_probs`` are p_0..p_k, of ``draft_probs`` q_0..q_{k-1}."""
    k = draft_tokens.size
    accept_key, residual_key, bonus_key = mx.random.split(key, 3)
    p_of_draft = mx.take_along_axis(target_probs[:k], draft_tokens[:, None], axis=-1)[:, 0]
    q_of_draft = mx.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]
    uniform = mx.random.uniform(shape=(k,), key=accept_key)
    accepted = _leading_true(uniform * q_of_draft < p_of_draft)  # u < p/q without dividing by 0

    residual = mx.maximum(target_probs[:k] - draft_probs, 0.0)
    residual_mass = mx.sum(residual, axis=-1, keepdims=True)
    # p == q leaves no residual; a rejection is then impossible, keep p for shape's sake.
    residual = mx.where(residual_mass > 0, residual / mx.maximum(residual_mass, 1e-30), target_probs[:k])
    replacements = sample(residual, residual_key)
    bonus = sample(target_probs[k], bonus_key)
    candidates = mx.concatenate([replacements, bonus[None]])
    return Verdict(accepted, candidates[accepted])


def _leading_true(flags: mx.array) -> mx.array:
    """Length of the run of True at the start of a 1-d boolean array."""
    if flags.size == 0:
        return mx.array(0)
    return mx.sum(mx.cumprod(flags.astype(mx.int32)))


def point_mass(tokens: mx.array, vocab: int) -> mx.array:
    """Draft 'distributions' of a drafter without one (n-gram lookup): all mass on the proposed token.

    With these, ``verify_sampled`` keeps a drafted token d with probability p(d), and on a
    rejection draws from p with d removed and renormalised (max(0, p - q)): the emitted
    tokens are still distributed exactly as the target's own samples.
    """
    return (mx.arange(vocab)[None, :] == tokens.astype(mx.int32)[:, None]).astype(mx.float32)
