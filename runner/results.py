"""What a request produces, as plain values: its rounds, their log-probabilities, its stats.

A leaf module: the engine, the session, the batch and the gRPC servicer all use these types, and it imports
none of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from common.requests import FinishReason


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
    depths: dict[int, int] = field(default_factory=dict)  # draft depth -> rounds at that depth
    forced: int = 0  # tokens a grammar forced (runner.constraint): certain, not counted as drafted

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
    finish_reason: FinishReason | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when the request asks
    stop_sequence: str = ""  # the last round: the stop string that ended it, if one did
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # the first round, when asked


def merged(first: Round, then: Round) -> Round:
    """Two consecutive rounds of one request as one: what either emitted, in order; the second's end."""
    return Round(
        token_ids=first.token_ids + then.token_ids,
        text=first.text + then.text,
        drafted=first.drafted + then.drafted,
        accepted=first.accepted + then.accepted,
        finish_reason=then.finish_reason,
        stats=then.stats,
        logprobs=first.logprobs + then.logprobs,
        stop_sequence=then.stop_sequence,
        prompt_logprobs=first.prompt_logprobs + then.prompt_logprobs,
    )


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
