"""One request inside the engine, from its prefill to its final round.

A ``Session`` holds everything a request carries through the decode loop: the
prepared request, its decoder (the model-side state, ``runner.decoders``), its
stopping criteria, its release schedule and its stats. It advances in units the
MLX thread can interleave with other requests: one prefill chunk
(``prefill_chunk``), one round of its own decoder when it runs alone
(``solo_round``), or the token a batched step chose for it (``batch_step``,
see ``runner.batch``). ``final_round`` ends it: stats, the prompt cache, the
end-of-request pool release.

The session is the one owner of its request's state. Its decoder and caches change
hands only through its own methods: ``join_batch`` gives its cache to a ``Batch``,
``batch_step`` takes the token a batched step chose for it, ``leave_batch`` takes its
cache back (or lets it go). ``Batch`` and ``MlxWorker`` talk to sessions, never to
their decoders. The engine builds a session from its parts (``Engine.session``): the
decoder, the release schedule, the prefill planner, and where its caches go at the
end; the session never sees the engine.
"""

from __future__ import annotations

import time
from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from common.reasoning import answer_start as reasoning_answer_start
from common.requests import FinishReason

from .constraint import ConstraintBroken
from .decoders import Decoder
from .prefill import PrefillPlanner
from .release import ReleaseSchedule
from .request import PreparedRequest
from .results import GenerationStats, Round, TokenLogprob, token_logprobs
from .stopping import StoppingCriteria


class Session:
    def __init__(
        self,
        prepared: PreparedRequest,
        decoder: Decoder,
        *,
        tokenizer,
        cached_tokens: int,
        schedule: ReleaseSchedule,
        planner: PrefillPlanner,
        keep=None,
    ):
        """``cached_tokens``: what the decoder's caches hold of the prompt already (a prompt-cache hit);
        ``keep(tokens, caches)``: where its caches go when it ends (the prompt cache), or None."""
        self.prepared = prepared
        self._decoder = decoder
        self._tokenizer = tokenizer
        self._keep = keep
        fmt = prepared.reasoning
        answer_start = None if fmt is None else partial(reasoning_answer_start, fmt=fmt, thinking=prepared.thinking)
        harmony = fmt is not None and fmt.kind == "harmony"  # its channel markers are special tokens: kept as text
        self.stopping = StoppingCriteria(
            tokenizer, prepared.eos_ids, prepared.request.stop, prepared.max_tokens, answer_start, harmony
        )
        if prepared.request.resume_ids:  # another runner's answer, going on
            self.stopping.prime(prepared.request.resume_ids, prepared.request.resume_text)
        self.schedule = schedule
        self.stats = GenerationStats(
            prompt_tokens=len(prepared.prompt_ids), cached_tokens=cached_tokens, drafter=decoder.drafter_name
        )
        self.planner = planner
        mx.reset_peak_memory()
        self.start = time.perf_counter()
        self.prefilled = False
        self.finish_reason: FinishReason | None = None
        self.final = None  # the final Round, once there is one
        # It ends with this error: its grammar could not go on (ConstraintBroken), or its client read too slowly
        # (common.errors.ClientTooSlow, from runner.worker).
        self.error: Exception | None = None
        self._in_batch = False  # its cache lives in a Batch

    # -- prefill ------------------------------------------------------------------------------------

    def prefill_chunk(self) -> bool:
        """Run one chunk of the prompt; True once the whole prompt (but its last token) is in."""
        if not self.prefilled:
            self.prefilled = self._decoder.prefill_step(self.planner, sizes=self.stats.prefill_chunks)
            if self.prefilled:
                self.stats.prefill_seconds = time.perf_counter() - self.start
        return self.prefilled

    def joint_prefill(self) -> tuple[int, int] | None:
        """(tokens cached, tokens to prefill) when what its prompt still lacks may share a batched pass with
        other requests' (``runner.prefill.joint_groups``): every cache of plain KV layers; else None."""
        if self.prefilled or self._decoder.score_prompt is not None or self._decoder.seen is not None:
            # scored prompts and prompts with images (their embeddings) prefill alone
            return None
        parts = self._decoder.prefill_parts()
        if not parts or not all(type(layer) is KVCache for _, cache, _, _ in parts for layer in cache):
            return None
        remaining = max(len(tokens) for _, _, tokens, _ in parts)
        return len(self.prepared.prompt_ids) - 1 - remaining, remaining

    def prefilled_state(self) -> tuple[list[int], list]:
        """Once prefilled: the prompt but its last token, and the caches that hold it (still its own: a caller
        that keeps them copies them, ``runner.prompt_cache.trimmed_copy``)."""
        assert self.prefilled and not self._in_batch, "not prefilled, or its cache is in a batch"
        return self._decoder.cached_state()

    def prefill_parts(self) -> list[tuple]:
        """What each of its models still lacks of the prompt (``Decoder.prefill_parts``), for a shared pass."""
        return self._decoder.prefill_parts()

    def prefilled_jointly(self, size: int) -> None:
        """``runner.batch.prefill_jointly`` put the last ``size`` tokens of its prompt in."""
        self.stats.prefill_chunks.append(size)
        self._decoder.quantize_due()  # as its own prefill would have (kv_bits)
        self.prefilled = True
        self.stats.prefill_seconds = time.perf_counter() - self.start

    # -- rounds -------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        return self.prepared.max_tokens - self.stats.generated_tokens

    def solo_round(self) -> Round:
        """One round of its own decoder (plain or speculative)."""
        assert not self._in_batch, "a session in a batch decodes through it"
        try:
            step = self._decoder.step(self.budget)
        except ConstraintBroken as error:
            return self._broken(error)
        self._decoder.quantize_due()
        self.stats.forced += step.forced
        return self._take(step.tokens, step.drafted, step.accepted, step.logits)

    def _broken(self, error: ConstraintBroken) -> Round:
        """Its grammar failed (runner.constraint): it ends, with the error, and its caches are not kept."""
        self.error = error
        self.finish_reason = FinishReason.STOP
        return Round([], "")

    # -- in a batch (runner.batch) ------------------------------------------------------------------

    @property
    def in_batch(self) -> bool:
        return self._in_batch

    @property
    def greedy(self) -> bool:
        return self._decoder.params.greedy

    @property
    def plain_choice(self) -> bool:
        """Its token after a batched step is the argmax of its raw row (greedy, no bias, no grammar)."""
        return self._decoder.plain_choice

    @property
    def constrained(self) -> bool:
        """Under a grammar: its token after a batched step needs the mask after its previous token."""
        return self._decoder.constraint is not None

    @property
    def pending(self) -> int:
        """The last token chosen, which its cache has not seen yet: the batch feeds it next."""
        return self._decoder.pending

    @property
    def keeps_cache(self) -> bool:
        """Whether its caches go to the prompt cache when it ends (so a batch gives them back)."""
        return self._keep is not None

    def settle(self) -> Round | None:
        """Before joining a batch: the round of a token its pipelined decoder has queued (or of the pass a
        constrained round queued), if any, so its cache holds exactly every token but ``pending``."""
        try:
            step = self._decoder.settle(self.budget)
        except ConstraintBroken as error:
            return self._broken(error)
        if step is None:
            return None
        self.stats.forced += step.forced
        return self._take(step.tokens, 0, 0, step.logits)

    def join_batch(self) -> list:
        """Its cache, for the batch to merge in (after ``settle``); the batch decodes it from now on."""
        assert not self._in_batch, "already in a batch"
        self._in_batch = True
        return self._decoder.hand_over()

    def choose_next(self, logits: mx.array) -> mx.array:
        """Its token after a batched step's row ``logits`` (lazy): its own sampling rule and random key."""
        return self._decoder.choose_next(logits)

    def batch_step(self, token: int, logits: mx.array) -> Round:
        """A batched step fed ``pending`` and chose ``token`` (``logits``: its row, (1, vocab))."""
        try:
            self._decoder.fed_by_batch([token])
        except ConstraintBroken as error:
            return self._broken(error)
        self._decoder.stats.depths[0] += 1
        return self._take([token], 0, 0, logits)

    def leave_batch(self, cache: list | None) -> None:
        """Out of the batch: ``cache`` is its own again (extracted, every token but ``pending``), to go on
        alone or for the prompt cache; None when the batch kept it (it ends without one)."""
        assert self._in_batch, "not in a batch"
        self._in_batch = False
        if cache is not None:
            self._decoder.take_back(cache)

    # -- the end ------------------------------------------------------------------------------------

    def _take(self, tokens: list[int], drafted: int, accepted: int, logits) -> Round:
        """The tokens a round chose, through the stopping criteria; returns the Round to stream."""
        emitted, delta = [], ""
        for token in tokens:
            decision = self.stopping(token)
            if decision.emit:
                emitted.append(token)
                delta += decision.text
            if decision.finish_reason is not None:
                self.finish_reason = decision.finish_reason
                break
        constraint = self._decoder.constraint
        if self.finish_reason is None and constraint is not None and constraint.finished:
            self.finish_reason = FinishReason.STOP  # the grammar is complete (its end consumed, even if emitted)
        logprobs = (
            token_logprobs(self._tokenizer, logits, emitted, self.prepared.top_logprobs)
            if self.prepared.logprobs
            else []
        )
        stats = self.stats
        before = stats.generated_tokens
        stats.generated_tokens += len(emitted)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        prompt_scores = []
        if stats.rounds == 1:
            stats.time_to_first_token = time.perf_counter() - self.start
            prompt_scores = self.scored_prompt()
        if not self._in_batch:  # a batch releases for all its rows (runner.batch)
            self.schedule.after_round(before, stats.generated_tokens)
        return Round(emitted, delta, drafted, accepted, logprobs=logprobs, prompt_logprobs=prompt_scores)

    def scored_prompt(self) -> list:
        """The prompt's tokens with their log-probabilities, when asked (the first has none: 0 here)."""
        scores = getattr(self._decoder, "prompt_scores", None)
        if scores is None:
            return []
        first = self.prepared.prompt_ids[0]
        return [TokenLogprob(first, self._tokenizer.decode([first]), 0.0), *scores]

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = FinishReason.CANCELLED

    def abandon(self) -> None:
        """An error ends it: no prompt-cache entry (its caches may be half-written), the pool released."""
        try:
            if self._decoder.cache is not None:
                self._decoder.close()
        finally:
            self.schedule.at_end()

    def final_round(self, last=None):
        """End the request: the prompt cache keeps its caches, the pool is released, the stats are complete.

        ``last`` is the round that ended it (its text gets the held-back tail); a cancelled request
        ends with an empty round.
        """
        if self.final is not None:
            return self.final
        stats = self.stats
        try:
            if self._keep is not None and not self._in_batch and self._decoder.cache is not None and not self.error:
                self._keep(*self._decoder.cached_state())
            stats.depths = dict(self._decoder.stats.depths)
            self._decoder.close()
        finally:
            self.schedule.at_end()
        if not stats.prefill_seconds:
            stats.prefill_seconds = time.perf_counter() - self.start
        stats.decode_seconds = time.perf_counter() - self.start - stats.prefill_seconds
        stats.releases = self.schedule.count
        stats.release_positions = list(self.schedule.positions)
        stats.active_memory = mx.get_active_memory()
        stats.cache_memory = mx.get_cache_memory()
        stats.peak_memory = mx.get_peak_memory()
        if self.finish_reason == FinishReason.CANCELLED or last is None:
            last = Round([], "")
        else:
            last.text += self.stopping.finish()
        last.finish_reason = self.finish_reason or FinishReason.CANCELLED
        last.stop_sequence = self.stopping.text.stop_string
        last.stats = stats
        self.final = last
        return last
