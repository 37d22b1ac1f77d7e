"""The decode engine: a target model, an optional draft, and the speculative decode loop.

``Engine.generate`` is a generator of ``Round`` objects, one per speculative
round: the draft proposes up to k tokens, the target checks them in one
forward pass, the accepted prefix plus one target token is emitted, and both
KV caches are rewound past the rejected part. After every round the release
rule (``runner.release``) decides whether the round crossed a multiple of the
release interval and, if so, empties MLX's buffer pool.

mlx-lm provides the model classes and KV caches; the loop is our own because
mlx-lm's ``speculative_generate_step`` never releases the pool while decoding.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import psutil
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .defaults import (DEFAULT_DTYPE, DEFAULT_NUM_DRAFT_TOKENS, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SCORE_BYTES,
                       DEFAULT_RELEASE_INTERVAL, DEFAULT_STALL_AFTER)
from .errors import TokenizerMismatch
from .footprint import ModelFootprint, default_prompt_cache_bytes, expected_device, resolve_dtype
from .loading import LoadedModel, load_model
from .malloc import malloc_trim
from .prefill import PrefillPlanner
from .prompt_cache import Hit, PromptCache
from .release import ReleaseSchedule
from .request import GenerationRequest, PreparedRequest, prepare
from .sampling import SamplingParams, filtered_probs, sample, verify_greedy, verify_sampled
from .stopping import StoppingCriteria

log = logging.getLogger("runner")

# Cache-limit settings: MLX's own default, or the memory limit (what Metal and
# CUDA default to, and what makes the pool's growth visible on the CPU).
CACHE_LIMIT_DEFAULT = "default"
CACHE_LIMIT_UNBOUNDED = "unbounded"


@dataclass(frozen=True)
class EngineSettings:
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    release_interval: int = DEFAULT_RELEASE_INTERVAL
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    cache_limit: str | int = CACHE_LIMIT_DEFAULT  # "default", "unbounded" or bytes
    release_enabled: bool = True  # debug: False reproduces the pool leak
    dtype: str = DEFAULT_DTYPE  # "auto", "checkpoint" or "float32" (runner.loading)
    max_context: int | None = None  # lowers the model's context length
    prefill_seconds: float = DEFAULT_STALL_AFTER / 4  # a prefill chunk should take about this long, at most
    prefill_score_bytes: int = DEFAULT_PREFILL_SCORE_BYTES  # CPU attention's transient score matrix, at most
    prompt_cache_bytes: int | None = None  # the prompt cache's budget; None = default_prompt_cache_bytes(), 0 = off
    malloc_trim: bool = True  # give freed heap back to the system after each pool release (glibc)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    time_to_first_token: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    releases: int = 0
    release_positions: list[int] = field(default_factory=list)
    active_memory: int = 0
    cache_memory: int = 0
    peak_memory: int = 0
    prefill_chunks: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused from the prompt cache
    drafter: str = "none"  # what proposed the drafts

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return (self.prompt_tokens - 1) / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


@dataclass
class TokenLogprob:
    token: int
    text: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # most likely first


@dataclass
class Round:
    """What one round emitted. The last round carries finish_reason and stats."""

    token_ids: list[int]
    text: str
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asks


def token_logprobs(tokenizer, logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Log-probabilities of ``tokens`` under the rows of ``logits`` that chose them (row i for token i),
    and the ``top`` most likely tokens of each row. The target's raw distribution: no temperature or filters."""
    if not tokens:
        return []
    rows = logits[: len(tokens)].astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top_ids = top_values = None
    if top:
        top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_values)
    else:
        mx.eval(chosen)
    result = []
    for i, (token, value) in enumerate(zip(tokens, chosen.tolist())):
        alternatives = []
        if top:
            pairs = sorted(zip(top_ids[i].tolist(), top_values[i].tolist()), key=lambda p: -p[1])
            alternatives = [(t, tokenizer.decode([t]), v) for t, v in pairs]
        result.append(TokenLogprob(token, tokenizer.decode([token]), value, alternatives))
    return result


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    target_vocab = target.tokenizer.get_vocab()
    draft_vocab = draft.tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        differing = len(set(target_vocab.items()) ^ set(draft_vocab.items()))
        raise TokenizerMismatch(
            draft.path,
            f"the draft's tokenizer differs from the target's ({target.path}): "
            f"{len(draft_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ",
        )


def apply_cache_limit(setting: str | int) -> int:
    """Sets MLX's pool cap; returns the cap now in force."""
    if setting == CACHE_LIMIT_UNBOUNDED:
        limit = mx.get_memory_limit()
    elif setting == CACHE_LIMIT_DEFAULT:
        previous = mx.set_cache_limit(0)  # read the current value back...
        mx.set_cache_limit(previous)  # ...and restore it
        return previous
    else:
        limit = int(setting)
    mx.set_cache_limit(limit)
    return limit


@dataclass(frozen=True)
class Released:
    cache_before: int  # MLX's pool, bytes
    cache_after: int
    evicted_entries: int = 0  # prompt-cache entries emptied first
    evicted_bytes: int = 0


def device_name() -> str:
    return mx.default_device().type.name  # "cpu" or "gpu"


class Engine:
    """A loaded target (and optional draft) that generates one request at a time."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, settings: EngineSettings,
                 dtype_reason: str = ""):
        self.target = target
        self.draft = draft
        self.settings = settings
        self.tokenizer = target.tokenizer
        self.vocab_size = target.vocab_size
        self.device = device_name()
        self.dtype_reason = dtype_reason or f"dtype = {target.dtype!r}"
        self.cache_limit = apply_cache_limit(settings.cache_limit)
        self.total_releases = 0
        budget = settings.prompt_cache_bytes
        self.prompt_cache = PromptCache(default_prompt_cache_bytes() if budget is None else budget)
        self.speculative, self.speculative_note = self._can_speculate()

    def _can_speculate(self) -> tuple[bool, str]:
        if self.draft is None:
            return False, "no draft model"
        for loaded in (self.target, self.draft):
            if not loaded.rewindable:
                return False, (f"{loaded.path.name}'s cache cannot be rewound ({loaded.cache_description()}): "
                               "plain decoding")
        return True, "draft model"

    @classmethod
    def load(cls, target_dir, draft_dir=None, settings: EngineSettings = EngineSettings()) -> "Engine":
        folders = [Path(target_dir)] + ([Path(draft_dir)] if draft_dir else [])
        dtype, reason = settings.dtype, ""
        if dtype == "auto":
            try:
                footprints = [ModelFootprint.of(folder) for folder in folders]
            except (OSError, ValueError):
                footprints = None  # load_model reports what is wrong with the folder
            if footprints is not None:
                dtype, reason = resolve_dtype("auto", device_name(), footprints, psutil.virtual_memory().available,
                                              context=settings.max_context)
            else:
                dtype = "float32" if device_name() == "cpu" else "checkpoint"
        target = load_model(folders[0], dtype, settings.max_context)
        draft = load_model(folders[1], dtype, settings.max_context) if draft_dir else None
        if draft is not None:
            check_same_vocabulary(target, draft)
        return cls(target, draft, settings, reason)

    @property
    def context_length(self) -> int:
        return self.target.context_length

    @property
    def default_num_draft_tokens(self) -> int:
        return self.settings.num_draft_tokens if self.speculative else 0

    def warm_up(self) -> None:
        """One short generation, so the first real request does not pay for first-use setup."""
        for _ in self.generate(GenerationRequest(prompt_ids=(0, 5, 6, 7), max_tokens=8, ignore_eos=True,
                                                 cache_prompt=False)):
            pass

    def release_memory(self, prompt_cache: bool = False) -> Released:
        """Empty the pool now (after the prompt cache, when asked): its buffers go back to the system."""
        entries, evicted = self.prompt_cache.clear() if prompt_cache else (0, 0)
        before = mx.get_cache_memory()
        mx.clear_cache()
        if self.settings.malloc_trim:
            malloc_trim()
        self.total_releases += 1
        return Released(before, mx.get_cache_memory(), entries, evicted)

    def prepare(self, request: GenerationRequest) -> PreparedRequest:
        """Validate and tokenize a request once (raises InvalidRequest naming the field)."""
        return prepare(request, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                       context_length=self.context_length, default_num_draft_tokens=self.default_num_draft_tokens,
                       can_draft=self.speculative)

    def prefill_planner(self) -> PrefillPlanner:
        heads = max(getattr(m.model.args, "num_attention_heads", 1) or 1
                    for m in filter(None, (self.target, self.draft)))
        return PrefillPlanner(heads, self.settings.prefill_chunk, self.settings.prefill_seconds,
                              self.settings.prefill_score_bytes if self.device == "cpu" else None)

    # -- generation ---------------------------------------------------------

    def generate(self, request: GenerationRequest | PreparedRequest, cancelled=lambda: False) -> Iterator[Round]:
        """Stream the rounds of one request.

        ``cancelled()`` is called between prefill chunks and between rounds: it is
        where the caller shows progress, and it ends the generation by returning True.
        """
        prepared = request if isinstance(request, PreparedRequest) else self.prepare(request)
        reuse = self.prompt_cache.lookup(prepared.prompt_ids) if prepared.cache_prompt else Hit(0, None)
        decoder = _Decoder(self, prepared.prompt_ids, prepared.params, prepared.num_draft_tokens,
                           mx.random.key(prepared.seed), reuse)
        stopping = StoppingCriteria(self.tokenizer, prepared.eos_ids, prepared.request.stop, prepared.max_tokens)
        schedule = ReleaseSchedule(self.release_memory, self.settings.release_interval, self.settings.release_enabled)
        stats = GenerationStats(prompt_tokens=len(prepared.prompt_ids), cached_tokens=reuse.tokens,
                                drafter="model" if decoder.k > 0 else "none")
        max_tokens = prepared.max_tokens

        mx.reset_peak_memory()
        start = time.perf_counter()
        finish_reason = None
        final_round = Round([], "")
        completed = False
        try:
            if not decoder.prefill(self.prefill_planner(), cancelled, stats.prefill_chunks):
                finish_reason = "cancelled"
            stats.prefill_seconds = time.perf_counter() - start
            while finish_reason is None:
                if cancelled():
                    finish_reason = "cancelled"
                    break
                proposed, drafted, accepted = decoder.round(max_tokens - stats.generated_tokens)
                emitted, delta = [], ""
                for token in proposed:
                    decision = stopping(token)
                    if decision.emit:
                        emitted.append(token)
                        delta += decision.text
                    if decision.finish_reason is not None:
                        finish_reason = decision.finish_reason
                        break
                logprobs = (token_logprobs(self.tokenizer, decoder.logits, emitted, prepared.top_logprobs)
                            if prepared.logprobs else [])
                before = stats.generated_tokens
                stats.generated_tokens += len(emitted)
                stats.rounds += 1
                stats.drafted += drafted
                stats.accepted += accepted
                if stats.rounds == 1:
                    stats.time_to_first_token = time.perf_counter() - start
                schedule.after_round(before, stats.generated_tokens)
                if finish_reason is None:
                    yield Round(emitted, delta, drafted, accepted, logprobs=logprobs)
                else:
                    final_round = Round(emitted, delta, drafted, accepted, logprobs=logprobs)
            completed = True
        finally:
            if completed and prepared.cache_prompt:  # what the caches hold is sound: later requests may start here
                self.prompt_cache.store(*decoder.cached_state())
            decoder.close()
            schedule.at_end()
        if not stats.prefill_seconds:
            stats.prefill_seconds = time.perf_counter() - start
        stats.decode_seconds = time.perf_counter() - start - stats.prefill_seconds
        stats.releases = schedule.count
        stats.release_positions = list(schedule.positions)
        stats.active_memory = mx.get_active_memory()
        stats.cache_memory = mx.get_cache_memory()
        stats.peak_memory = mx.get_peak_memory()
        if finish_reason == "cancelled":
            final_round = Round([], "")
        else:
            final_round.text += stopping.finish()
        final_round.finish_reason = finish_reason
        final_round.stats = stats
        yield final_round


class _Decoder:
    """The model-side state of one request: both KV caches and the pending token.

    Invariant between rounds: both caches hold every emitted token except the
    last one, ``pending``, which neither model has seen yet. After a round in
    which every draft was accepted, the draft has also not seen the last
    draft token, which ``draft_backlog`` carries into the next round.

    ``reuse`` is a prompt-cache hit: the request's own copies of caches that
    already hold the first ``reuse.tokens`` prompt tokens, so only the rest is
    prefilled.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, k: int, key,
                 reuse: Hit | None = None):
        self.engine = engine
        self.target = engine.target.model
        self.draft = engine.draft.model if engine.draft is not None and k > 0 else None
        self.params = params
        self.k = k if self.draft is not None else 0
        self.key = key
        self.prompt_ids = prompt_ids
        self.tokens = list(prompt_ids)  # the prompt, then every token a round chose
        self.target_cache = make_prompt_cache(self.target)
        self.draft_cache = make_prompt_cache(self.draft) if self.draft is not None else None
        self.target_held = self.draft_held = 0  # tokens each cache holds
        if reuse is not None and reuse.caches:
            self.target_cache, self.target_held = reuse.caches[0], reuse.tokens
            if self.draft is not None and len(reuse.caches) > 1 and reuse.caches[1] is not None:
                self.draft_cache, self.draft_held = reuse.caches[1], reuse.tokens
        self.pending = prompt_ids[-1]
        self.draft_backlog: list[int] = []
        self.logits: mx.array | None = None

    def prefill(self, planner: PrefillPlanner, between=lambda: False, sizes: list | None = None) -> bool:
        """Run the prompt (all but its last token) through both models in planned chunks,
        each from where its cache already is.

        ``between()`` runs after every chunk (the caller's sign of progress); when it
        returns True the prefill stops there and this returns False.
        """
        context = self.prompt_ids[:-1]
        offset = min(held for _, _, held in self._models())
        while offset < len(context):
            size = planner.next_chunk(offset, len(context) - offset)
            started = time.perf_counter()
            for model, cache, held in self._models():
                if held < offset + size:
                    model(mx.array(context[max(held, offset) : offset + size])[None], cache=cache)
                    mx.eval([c.state for c in cache])
            self.target_held = max(self.target_held, offset + size)
            if self.draft is not None:
                self.draft_held = max(self.draft_held, offset + size)
            mx.clear_cache()
            planner.record(offset, size, time.perf_counter() - started)
            offset += size
            if sizes is not None:
                sizes.append(size)
            if between():
                return False
        return True

    def cached_state(self) -> tuple[list[int], list]:
        """The tokens the caches hold and the caches themselves, for the prompt cache (the request is over)."""
        held = self.target_held
        caches = [self.target_cache]
        if self.draft is not None:
            if self.draft_held < held:  # the draft lags by its backlog: keep what both hold
                trim_prompt_cache(self.target_cache, held - self.draft_held)
                held = self.draft_held
            caches.append(self.draft_cache)
        return self.tokens[:held], caches

    def round(self, budget: int) -> tuple[list[int], int, int]:
        """One speculative round; returns (tokens, drafted, accepted), never more than ``budget`` tokens."""
        k = min(self.k, budget - 1)
        self.key, round_key = mx.random.split(self.key)
        draft_key, verify_key = mx.random.split(round_key)
        draft_tokens, draft_probs = self._propose(k, draft_key)
        verify_input = mx.array([self.pending], dtype=mx.uint32)
        if k > 0:
            verify_input = mx.concatenate([verify_input, draft_tokens.astype(mx.uint32)])
        logits = self.target(verify_input[None], cache=self.target_cache)[0]
        self.logits = logits  # row i chose the i-th token of this round
        if k == 0:
            next_token = self._choose(logits[-1], verify_key)
            mx.eval(next_token)
            accepted = 0
            tokens = [next_token.item()]
        else:
            if self.params.greedy:
                verdict = verify_greedy(logits, draft_tokens)
            else:
                verdict = verify_sampled(filtered_probs(logits, self.params), draft_probs, draft_tokens, verify_key)
            mx.eval(verdict.accepted, verdict.next_token, draft_tokens)
            accepted = verdict.accepted.item()
            drafts = draft_tokens.tolist()
            tokens = drafts[:accepted] + [verdict.next_token.item()]
            self._rewind(k, accepted, drafts)
        self.pending = tokens[-1]
        self.tokens += tokens
        self.target_held = len(self.tokens) - 1  # all but pending
        self.draft_held = self.target_held - len(self.draft_backlog)
        return tokens, k, accepted

    def _propose(self, k: int, key) -> tuple[mx.array | None, mx.array | None]:
        """The draft's k proposals (lazy) and, when sampling, its distributions."""
        if k == 0:
            return None, None
        inputs = self.draft_backlog + [self.pending]
        self.draft_backlog = []
        tokens, probs = [], []
        step_input = mx.array(inputs)
        for step_key in mx.random.split(key, k):
            logits = self.draft(step_input[None], cache=self.draft_cache)[0, -1]
            if self.params.greedy:
                token = mx.argmax(logits, axis=-1)
            else:
                q = filtered_probs(logits, self.params)
                token = sample(q, step_key)
                probs.append(q)
            mx.async_eval(token)
            tokens.append(token)
            step_input = token[None]
        return mx.stack(tokens), (mx.stack(probs) if probs else None)

    def _choose(self, logits: mx.array, key) -> mx.array:
        if self.params.greedy:
            return mx.argmax(logits, axis=-1)
        return sample(filtered_probs(logits, self.params), key)

    def _rewind(self, k: int, accepted: int, drafts: list[int]) -> None:
        """Drop the rejected drafts from both caches."""
        trim_prompt_cache(self.target_cache, k - accepted)
        # The draft saw pending + drafts[:-1]; it keeps pending + drafts[:accepted].
        if accepted == k:
            self.draft_backlog = [drafts[-1]]
        else:
            trim_prompt_cache(self.draft_cache, k - 1 - accepted)

    def _models(self):
        yield self.target, self.target_cache, self.target_held
        if self.draft is not None:
            yield self.draft, self.draft_cache, self.draft_held

    def close(self) -> None:
        self.target_cache = self.draft_cache = None

