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

import math
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from .errors import InvalidRequest, ModelLoadError, TokenizerMismatch
from .release import DEFAULT_RELEASE_INTERVAL, ReleaseSchedule
from .sampling import SamplingParams, filtered_probs, sample, verify_greedy, verify_sampled
from .text import TextStream

DEFAULT_NUM_DRAFT_TOKENS = 1  # best in bench/engine.py on the default pair (1.26x-1.48x over plain)
MAX_NUM_DRAFT_TOKENS = 16
DEFAULT_PREFILL_CHUNK = 2048
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256

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
    dtype: str | None = "float32"  # compute dtype; None keeps the checkpoint's


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()  # used instead of ``prompt`` when given
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_draft_tokens: int | None = None  # None = the engine's setting; 0 = no drafting
    ignore_eos: bool = False
    request_id: str = ""


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

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.generated_tokens / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class Round:
    """What one round emitted. The last round carries finish_reason and stats."""

    token_ids: list[int]
    text: str
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None  # "stop", "length" or "cancelled"
    stats: GenerationStats | None = None


@dataclass
class LoadedModel:
    path: Path
    model: object
    tokenizer: object
    config: dict

    @property
    def parameters(self) -> int:
        return sum(v.size for _, v in tree_flatten(self.model.parameters()))

    @property
    def dtype(self) -> str:
        first = next(iter(tree_flatten(self.model.parameters())))[1]
        return str(first.dtype).removeprefix("mlx.core.")

    @property
    def context_length(self) -> int:
        return int(self.config.get("max_position_embeddings") or 2048)


def load_model(folder: str | Path, dtype: str | None) -> LoadedModel:
    """Load one mlx-lm model folder, turning every failure into ModelLoadError."""
    from mlx_lm.utils import load as mlx_lm_load

    path = Path(folder)
    if not path.is_dir():
        raise ModelLoadError(path, "no such folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(path, "config.json is missing")
    try:
        model, tokenizer, config = mlx_lm_load(str(path), return_config=True)
        if dtype is not None:
            model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
    except Exception as error:  # noqa: BLE001 - any cause is reported with the folder
        raise ModelLoadError(path, f"{type(error).__name__}: {error}") from error
    return LoadedModel(path, model, tokenizer, config)


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


class Engine:
    """A loaded target (and optional draft) that generates one request at a time."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None, settings: EngineSettings):
        self.target = target
        self.draft = draft
        self.settings = settings
        self.tokenizer = target.tokenizer
        self.vocab_size = target.model.args.vocab_size
        self.cache_limit = apply_cache_limit(settings.cache_limit)
        self.total_releases = 0

    @classmethod
    def load(cls, target_dir, draft_dir=None, settings: EngineSettings = EngineSettings()) -> "Engine":
        target = load_model(target_dir, settings.dtype)
        draft = load_model(draft_dir, settings.dtype) if draft_dir else None
        if draft is not None:
            check_same_vocabulary(target, draft)
        return cls(target, draft, settings)

    @property
    def context_length(self) -> int:
        return self.target.context_length

    def warm_up(self) -> None:
        """One short generation, so the first real request does not pay for first-use setup."""
        for _ in self.generate(GenerationRequest(prompt_ids=(0, 5, 6, 7), max_tokens=8, ignore_eos=True)):
            pass

    def release_memory(self) -> tuple[int, int]:
        """Empty the pool now; returns cache bytes before and after."""
        before = mx.get_cache_memory()
        mx.clear_cache()
        self.total_releases += 1
        return before, mx.get_cache_memory()

    # -- request checking ---------------------------------------------------

    def prepare(self, request: GenerationRequest) -> tuple[list[int], SamplingParams, int]:
        """Validate a request; returns prompt ids, sampling parameters and k."""
        if request.prompt_ids:
            prompt_ids = [int(t) for t in request.prompt_ids]
            if any(t < 0 or t >= self.vocab_size for t in prompt_ids):
                raise InvalidRequest("prompt_ids", f"token ids must lie in [0, {self.vocab_size})")
        elif request.prompt:
            prompt_ids = self.tokenizer.encode(request.prompt)
        else:
            raise InvalidRequest("prompt", "must not be empty")
        if len(prompt_ids) >= self.context_length:
            raise InvalidRequest(
                "prompt", f"{len(prompt_ids)} tokens do not fit the context of {self.context_length}"
            )
        if request.max_tokens <= 0:
            raise InvalidRequest("max_tokens", "must be positive")
        if not math.isfinite(request.temperature) or request.temperature < 0:
            raise InvalidRequest("temperature", "must be a finite number >= 0")
        if request.top_k < 0:
            raise InvalidRequest("top_k", "must be >= 0 (0 turns it off)")
        if not (math.isfinite(request.top_p) and 0 < request.top_p <= 1):
            raise InvalidRequest("top_p", "must lie in (0, 1]")
        if not (math.isfinite(request.min_p) and 0 <= request.min_p <= 1):
            raise InvalidRequest("min_p", "must lie in [0, 1]")
        if request.seed is not None and not 0 <= request.seed < 2**63:
            raise InvalidRequest("seed", "must lie in [0, 2**63)")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_LENGTH for s in request.stop):
            raise InvalidRequest("stop", f"each stop string is at most {MAX_STOP_LENGTH} characters")
        k = self.settings.num_draft_tokens if request.num_draft_tokens is None else request.num_draft_tokens
        if not 0 <= k <= MAX_NUM_DRAFT_TOKENS:
            raise InvalidRequest("num_draft_tokens", f"must lie in [0, {MAX_NUM_DRAFT_TOKENS}]")
        if self.draft is None:
            k = 0
        params = SamplingParams(request.temperature, request.top_k, request.top_p, request.min_p)
        return prompt_ids, params, k

    # -- generation ---------------------------------------------------------

    def generate(self, request: GenerationRequest, cancelled=lambda: False) -> Iterator[Round]:
        """Stream the rounds of one request. ``cancelled()`` is checked between rounds."""
        prompt_ids, params, k = self.prepare(request)
        max_tokens = min(request.max_tokens, self.context_length - len(prompt_ids))
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        decoder = _Decoder(self, prompt_ids, params, k, mx.random.key(seed))
        text = TextStream(self.tokenizer, request.stop)
        schedule = ReleaseSchedule(self.release_memory, self.settings.release_interval, self.settings.release_enabled)
        eos_ids = set() if request.ignore_eos else set(self.tokenizer.eos_token_ids)
        stats = GenerationStats(prompt_tokens=len(prompt_ids))

        mx.reset_peak_memory()
        start = time.perf_counter()
        decoder.prefill()
        stats.prefill_seconds = time.perf_counter() - start
        finish_reason = None
        try:
            while finish_reason is None:
                if cancelled():
                    finish_reason = "cancelled"
                    break
                proposed, drafted, accepted = decoder.round(max_tokens - stats.generated_tokens)
                emitted, delta = [], ""
                for token in proposed:
                    if token in eos_ids:
                        finish_reason = "stop"
                        break
                    emitted.append(token)
                    delta += text.add(token)
                    if text.stopped:
                        finish_reason = "stop"
                        break
                before = stats.generated_tokens
                stats.generated_tokens += len(emitted)
                stats.rounds += 1
                stats.drafted += drafted
                stats.accepted += accepted
                if stats.rounds == 1:
                    stats.time_to_first_token = time.perf_counter() - start
                if finish_reason is None and stats.generated_tokens >= max_tokens:
                    finish_reason = "length"
                schedule.after_round(before, stats.generated_tokens)
                if finish_reason is None:
                    yield Round(emitted, delta, drafted, accepted)
                else:
                    final_round = Round(emitted, delta, drafted, accepted)
        finally:
            decoder.close()
            schedule.at_end()
        stats.decode_seconds = time.perf_counter() - start - stats.prefill_seconds
        stats.releases = schedule.count
        stats.release_positions = list(schedule.positions)
        stats.active_memory = mx.get_active_memory()
        stats.cache_memory = mx.get_cache_memory()
        stats.peak_memory = mx.get_peak_memory()
        if finish_reason == "cancelled":
            final_round = Round([], "")
        final_round.text += text.finish()
        final_round.finish_reason = finish_reason
        final_round.stats = stats
        yield final_round


class _Decoder:
    """The model-side state of one request: both KV caches and the pending token.

    Invariant between rounds: both caches hold every emitted token except the
    last one, ``pending``, which neither model has seen yet. After a round in
    which every draft was accepted, the draft has also not seen the last
    draft token, which ``draft_backlog`` carries into the next round.
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams, k: int, key):
        self.engine = engine
        self.target = engine.target.model
        self.draft = engine.draft.model if engine.draft is not None and k > 0 else None
        self.params = params
        self.k = k if self.draft is not None else 0
        self.key = key
        self.prompt_ids = prompt_ids
        self.target_cache = make_prompt_cache(self.target)
        self.draft_cache = make_prompt_cache(self.draft) if self.draft is not None else None
        self.pending = prompt_ids[-1]
        self.draft_backlog: list[int] = []

    def prefill(self) -> None:
        """Run the prompt (all but its last token) through both models in chunks."""
        context = self.prompt_ids[:-1]
        chunk = self.engine.settings.prefill_chunk
        for model, cache in self._models():
            for start in range(0, len(context), chunk):
                model(mx.array(context[start : start + chunk])[None], cache=cache)
                mx.eval([c.state for c in cache])
                mx.clear_cache()

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
        yield self.target, self.target_cache
        if self.draft is not None:
            yield self.draft, self.draft_cache

    def close(self) -> None:
        self.target_cache = self.draft_cache = None

