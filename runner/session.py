"""One request inside the engine, from its prefill to its final round.

A ``Session`` holds everything a request carries through the decode loop: the
prepared request, its decoder (the model-side state, ``runner.decoders``), its
stopping criteria, its release schedule and its stats. It advances in units the
MLX thread can interleave with other requests: one prefill chunk
(``prefill_chunk``), one round of its own decoder when it runs alone
(``solo_round``), or the tokens a batched step chose for it (``take``, see
``runner.batch``). ``final_round`` ends it: stats, the prompt cache, the
end-of-request pool release.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .decoders import SpeculativeDecoder
from .prompt_cache import Hit
from .release import ReleaseSchedule
from .stopping import StoppingCriteria


class Session:
    def __init__(self, engine, prepared):
        from .engine import GenerationStats

        self.engine = engine
        self.prepared = prepared
        self.reuse = engine.prompt_cache.lookup(prepared.prompt_ids) if prepared.cache_prompt else Hit(0, None)
        self.decoder = engine.decoder(prepared, self.reuse)
        self.stopping = StoppingCriteria(engine.tokenizer, prepared.eos_ids, prepared.request.stop,
                                         prepared.max_tokens)
        self.schedule = ReleaseSchedule(engine.release_memory, engine.settings.release_interval,
                                        engine.settings.release_enabled)
        drafter = self.decoder.drafter.name if isinstance(self.decoder, SpeculativeDecoder) else "none"
        self.stats = GenerationStats(prompt_tokens=len(prepared.prompt_ids), cached_tokens=self.reuse.tokens,
                                     drafter=drafter)
        self.planner = engine.prefill_planner()
        mx.reset_peak_memory()
        self.start = time.perf_counter()
        self.prefilled = False
        self.finish_reason: str | None = None
        self.final = None  # the final Round, once there is one
        self.batched = False  # its cache lives in a Batch
        self.last_text_round = None

    # -- prefill ------------------------------------------------------------------------------------

    def prefill_chunk(self) -> bool:
        """Run one chunk of the prompt; True once the whole prompt (but its last token) is in."""
        if not self.prefilled:
            self.prefilled = self.decoder.prefill_step(self.planner, sizes=self.stats.prefill_chunks)
            if self.prefilled:
                self.stats.prefill_seconds = time.perf_counter() - self.start
        return self.prefilled

    def joint_prefill(self) -> tuple[int, int] | None:
        """(tokens cached, tokens to prefill) when what its prompt still lacks may share a batched pass with
        other requests' (``runner.prefill.joint_groups``): every cache of plain KV layers; else None."""
        if self.prefilled:
            return None
        parts = self.decoder.prefill_parts()
        if not parts or not all(type(layer) is KVCache for _, cache, _, _ in parts for layer in cache):
            return None
        remaining = max(len(tokens) for _, _, tokens, _ in parts)
        return len(self.prepared.prompt_ids) - 1 - remaining, remaining

    def prefilled_jointly(self, size: int) -> None:
        """``runner.batch.prefill_jointly`` put the last ``size`` tokens of its prompt in."""
        self.stats.prefill_chunks.append(size)
        self.prefilled = True
        self.stats.prefill_seconds = time.perf_counter() - self.start

    # -- rounds -------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def budget(self) -> int:
        return self.prepared.max_tokens - self.stats.generated_tokens

    def solo_round(self):
        """One round of its own decoder (plain or speculative)."""
        step = self.decoder.step(self.budget)
        return self.take(step.tokens, step.drafted, step.accepted, step.logits)

    def take(self, tokens: list[int], drafted: int, accepted: int, logits):
        """The tokens a round chose, through the stopping criteria; returns the Round to stream."""
        from .engine import Round, token_logprobs

        emitted, delta = [], ""
        for token in tokens:
            decision = self.stopping(token)
            if decision.emit:
                emitted.append(token)
                delta += decision.text
            if decision.finish_reason is not None:
                self.finish_reason = decision.finish_reason
                break
        logprobs = (token_logprobs(self.engine.tokenizer, logits, emitted, self.prepared.top_logprobs)
                    if self.prepared.logprobs else [])
        stats = self.stats
        before = stats.generated_tokens
        stats.generated_tokens += len(emitted)
        stats.rounds += 1
        stats.drafted += drafted
        stats.accepted += accepted
        if stats.rounds == 1:
            stats.time_to_first_token = time.perf_counter() - self.start
        if not self.batched:  # a batch releases for all its rows (runner.batch)
            self.schedule.after_round(before, stats.generated_tokens)
        return Round(emitted, delta, drafted, accepted, logprobs=logprobs)

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.finish_reason = "cancelled"

    def abandon(self) -> None:
        """An error ends it: no prompt-cache entry (its caches may be half-written), the pool released."""
        try:
            if self.decoder.cache is not None:
                self.decoder.close()
        finally:
            self.schedule.at_end()

    def final_round(self, last=None):
        """End the request: the prompt cache keeps its caches, the pool is released, the stats are complete.

        ``last`` is the round that ended it (its text gets the held-back tail); a cancelled request
        ends with an empty round.
        """
        from .engine import Round

        if self.final is not None:
            return self.final
        stats = self.stats
        try:
            if self.prepared.cache_prompt and not self.batched and self.decoder.cache is not None:
                self.engine.prompt_cache.store(*self.decoder.cached_state())
            stats.depths = dict(self.decoder.stats.depths)
            self.decoder.close()
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
        if self.finish_reason == "cancelled" or last is None:
            last = Round([], "")
        else:
            last.text += self.stopping.finish()
        last.finish_reason = self.finish_reason or "cancelled"
        last.stats = stats
        self.final = last
        return last
