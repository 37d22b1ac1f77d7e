"""Drafters: what proposes the tokens a speculative round asks the target to verify.

One small interface (``Drafter``): ``propose`` up to k tokens that would follow
the context; be told, through ``accepted``, how many the target kept. Two kinds:

- ``ModelDrafter``: a small draft model with the target's vocabulary, run
  autoregressively on its own KV cache (which it rewinds past rejected drafts);
  when sampling, its distributions ``q`` go to speculative sampling.
- ``NgramDrafter``: prompt lookup. The most recent earlier occurrence of the
  context's last n tokens (n from ``n_max`` down to ``n_min``), in the prompt
  plus everything generated so far, and what followed it. It needs no model and
  works for every target; it pays where the output copies from the input (edits
  of given code, extraction, lists repeated with changes). Its proposal is a
  point mass: with sampling, a drafted token is kept with probability p(token),
  else a token is drawn from p with that token removed and renormalised - still
  exactly the target's distribution (``runner.sampling.point_mass``).

Both are told every token the round emits (``extend``) so their view of the
context stays the target's. The drafters that read the target's hidden states
(``mtp``, ``head``, ``block`` beside this module) share ``HiddenStateDrafter``,
and a reduced draft vocabulary goes back to the target's with
``to_full_vocabulary``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from common.defaults import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN

from ..rewind import Rewinder
from ..sampling import SamplingParams, filtered_probs, sample

# Whether a drafter queues the next round's first draft with the target's verification (``queue_next``): a draft
# model, an MTP layer or a trained head (off only to measure it).
QUEUE_NEXT_DRAFT = True


def draft_token(logits: mx.array, params, key, probs: list) -> mx.array:
    """A drafter's token after ``logits`` (lazy): the argmax for a greedy request, else a sample of the request's
    filtered distribution, which goes into ``probs`` (the verifier's q)."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    q = filtered_probs(logits, params)
    probs.append(q)
    return sample(q, key)


def to_full_vocabulary(logits: mx.array, ids: mx.array, size: int) -> mx.array:
    """Logits over a reduced draft vocabulary (``ids``: the target token of each column, EAGLE-3's d2t) as logits
    over the target's ``size`` tokens, every token outside it at -inf: sampling and the verifier's q then see the
    target's vocabulary, and a drafter never proposes a token it cannot score."""
    full = mx.full((*logits.shape[:-1], size), -mx.inf, dtype=logits.dtype)
    full[..., ids] = logits
    return full


def tokens_after_verification(drafts: mx.array, verdict) -> mx.array:
    """The k + 1 tokens that follow the pending one whatever the ``verdict`` on ``drafts`` (lazy): the drafts, with
    the verdict's own token in place of the first one it rejects (after all k: last). Fed to a drafter, row a is its
    first draft for the outcome "a kept" (``queue_next``), causal attention keeping each row from the ones after it."""
    next_token = verdict.next_token.astype(mx.uint32)
    fed = mx.concatenate([drafts.astype(mx.uint32), next_token[None]])
    return mx.where(mx.arange(drafts.size + 1) == verdict.accepted, next_token, fed)


@dataclass
class Proposal:
    tokens: mx.array  # (k,) uint32, possibly lazy
    probs: mx.array | None  # (k, vocab) draft distributions when sampling with a model; None = point masses

    @property
    def size(self) -> int:
        return self.tokens.size


class Drafter(Protocol):
    name: str

    def propose(self, context: list[int], k: int, params: SamplingParams, key) -> Proposal | None:
        """Up to ``k`` tokens to follow ``context`` (the prompt and every token chosen so far; its last
        token, the pending one, is in no cache yet). ``key`` is None for a greedy request."""

    def queue_next(self, context: list[int], drafts: mx.array, verdict, params: SamplingParams, key) -> None:
        """The target's verification of ``drafts`` (proposed after ``context``) is queued, its ``verdict`` not read
        yet: queue the next round's first draft now, for every outcome at once, so the device computes it right
        after the verification while the host reads the verdict (``accepted`` then keeps the outcome's).
        Optional: a drafter that does nothing here drafts when next asked."""

    def accepted(self, proposal: Proposal, accepted: int) -> None:
        """The target kept the first ``accepted`` tokens of ``proposal``."""

    def extend(self, tokens: list[int]) -> None:
        """The context grew by ``tokens``."""

    def ready(self) -> bool:
        """Whether the next round will likely have a proposal, judged from the context so far (before the
        token the target is computing now is known); cheap."""


class ModelDrafter:
    """A draft model on its own KV cache.

    Its cache holds the first ``held`` tokens of the context. A proposal first
    feeds what it has not seen (the pending token, the last draft of a round
    that kept them all, the tokens of plain rounds), then drafts k tokens, one
    forward pass each; ``accepted`` takes its cache back past the rejected ones.
    Where its cache can be trimmed, it queues the next round's first draft with
    the target's verification (``queue_next``): it drops its chained drafts and
    feeds the k + 1 tokens that follow the pending one whatever the verdict (the
    drafts, the verdict's token at the position it takes, ``mx.where``); row a
    is the first draft after a kept drafts, and ``accepted`` trims the rows past
    it. Its pass then holds k + 1 rows, not one, and it runs while the host reads
    the verdict.
    """

    name = "model"

    def __init__(self, model, cache=None, held: int = 0):
        self.model = model
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.held = held  # context tokens its cache holds
        self.rewinder = Rewinder(self.model, self.cache)
        self._fed: list[int] = []
        self._queued: tuple | None = None  # (the verified round's pending position, its depth, drafts, q rows)
        self._next: tuple | None = None  # (the context's length it drafts after, its draft, its q row or None)

    def propose(self, context: list[int], k: int, params: SamplingParams, key) -> Proposal | None:
        if k <= 0:
            return None
        queued, self._next = self._next, None
        step_keys = mx.random.split(key, k) if key is not None else [None] * k
        tokens, probs = [], []
        self.rewinder.snapshot()
        if queued is not None and queued[0] == len(context) == self.held:  # queued with the verification
            _, token, q = queued
            tokens.append(token)
            probs += [q] if q is not None else []
            self._fed = []
            step_input, step_keys = token[None], step_keys[1:]
        else:
            inputs = context[self.held :]
            self._fed = list(inputs)
            step_input = mx.array(inputs)
        for step_key in step_keys:
            logits = self.model(step_input[None], cache=self.cache)[0, -1]
            token = draft_token(logits, params, step_key, probs)
            mx.async_eval(token)
            tokens.append(token)
            step_input = token[None]
        return Proposal(mx.stack(tokens).astype(mx.uint32), mx.stack(probs) if probs else None)

    def queue_next(self, context: list[int], drafts: mx.array, verdict, params: SamplingParams, key) -> None:
        k = drafts.size
        # Its cache holds the context (the pending token last) and the chained drafts 1..k-1.
        if not QUEUE_NEXT_DRAFT or not self.rewinder.trimmable or self.held + len(self._fed) != len(context):
            return
        trim_prompt_cache(self.cache, k - 1)
        following = tokens_after_verification(drafts, verdict)
        probs: list = []
        tokens = draft_token(self.model(following[None], cache=self.cache)[0], params, key, probs)
        mx.async_eval(tokens)
        self._queued = (len(context), k, tokens, probs[0] if probs else None)

    def accepted(self, proposal: Proposal, accepted: int) -> None:
        queued, self._queued = self._queued, None
        if queued is not None:  # it fed the k + 1 tokens after the context: it keeps the kept drafts and the next
            length, k, tokens, q = queued
            trim_prompt_cache(self.cache, k - accepted)
            self.held = length + accepted + 1
            self._next = (self.held, tokens[accepted], None if q is None else q[accepted])
            return
        k = proposal.size
        drafts = proposal.tokens.tolist()
        # It ran inputs + drafts[:-1]; it keeps inputs + drafts[:accepted] (all it ran when every draft was kept:
        # the last draft then waits, unseen, at the end of the context like any new token).
        kept = len(self._fed) + min(accepted, k - 1)
        self.rewinder.rewind(self._fed + drafts[:-1], kept)
        self.held += kept

    def extend(self, tokens: list[int]) -> None:
        pass  # it catches up from the context when it next proposes

    def ready(self) -> bool:
        return True  # it always proposes


class NgramDrafter:
    """Prompt lookup over the context (prompt plus generated tokens)."""

    name = "ngram"

    def __init__(self, context: list[int], n_max: int = DEFAULT_NGRAM_MAX, n_min: int = DEFAULT_NGRAM_MIN):
        self.n_max = n_max
        self.n_min = n_min
        self.context: list[int] = []
        # n-gram -> position of the token that followed its latest occurrence
        self.followers: dict[tuple[int, ...], int] = {}
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        context, followers = self.context, self.followers
        for token in tokens:
            position = len(context)
            for n in range(self.n_min, self.n_max + 1):
                if position >= n:
                    followers[tuple(context[position - n : position])] = position
            context.append(token)

    def lookup(self, k: int) -> list[int]:
        context = self.context
        for n in range(self.n_max, self.n_min - 1, -1):
            if len(context) < n:
                continue
            follower = self.followers.get(tuple(context[-n:]))
            if follower is not None:
                return context[follower : follower + k]
        return []

    def ready(self) -> bool:
        """The context's end occurred before: the output is likely copying, and the next token's lookup
        will likely find something too."""
        return bool(self.lookup(1))

    def propose(self, context: list[int], k: int, params: SamplingParams, key) -> Proposal | None:
        # Its own copy of the context (kept by ``extend``) carries the n-gram index.
        drafts = self.lookup(k) if k > 0 else []
        if not drafts:
            return None
        return Proposal(mx.array(drafts, dtype=mx.uint32), None)

    def accepted(self, proposal: Proposal, accepted: int) -> None:
        pass

    def queue_next(self, context, drafts, verdict, params, key) -> None:
        pass  # a lookup on the host: nothing for the device to start early


class HiddenStateDrafter:
    """What a drafter that reads the target's own hidden states shares (an MTP layer, a trained head, a block
    drafter): the target's verify pass hands it the kept positions, so it has nothing to rewind past rejected
    drafts, nothing to catch up from the emitted tokens, and a proposal every round."""

    def accepted(self, proposal: Proposal, accepted: int) -> None:
        pass  # its cache holds only positions the target kept

    def queue_next(self, context, drafts, verdict, params, key) -> None:
        pass

    def extend(self, tokens: list[int]) -> None:
        pass

    def ready(self) -> bool:
        return True
