"""How many prompt tokens each prefill forward pass takes.

Two limits, whichever is smaller:
- memory: on the CPU, MLX's attention materialises a (heads x chunk x context)
  float32 score matrix. Chunks are sized to keep it under ``score_bytes``, so a
  long prompt does not add hundreds of MB of transient memory (measured on the
  default pair at 8000 tokens: chunks of 256 were as fast as chunks of 2048
  with a third of the peak);
- time: the runner's MLX thread proves it is alive between chunks, and a chunk
  that takes longer than ``stall_after`` looks like a hang. The first chunk is a
  short probe; its speed, scaled for the longer context of the next chunk,
  sizes the rest to take about ``seconds`` each.

Short prompts that wait at the same time share a forward pass
(``joint_groups``; the pass itself is ``runner.batch.prefill_jointly``): a
pass over one row of a few tokens streams every weight for little arithmetic,
so 16 short prompts in one pass take about half the time they take one by one,
which is most of a burst of clients' time to first token. A prompt joins only
when what it lacks fits in a first chunk (``PROBE_CHUNK``), so a long one still
goes chunk by chunk; a shared pass takes at most ``JOINT_TOKENS`` tokens,
padding included (rows x the longest remainder), and its attention scores stay
under ``score_bytes``. A shared pass copies every row's cache twice (merged
into one batch, extracted again), and that copy grows with the cache: past
``JOINT_CONTEXT`` tokens it costs more than the shared pass saves, so a row
joins only while its cache stays within it. The figures are in docs/design.md
("Batching").

A forward pass over n tokens at context offset o costs about
n * r * (o + n/2 + c0): a fixed part per token (c0, in tokens of context) and
attention over the context, which grows with it. r is re-measured after every
chunk, so a machine that slows down shrinks the chunks that follow.
"""

from __future__ import annotations

import math

from common.defaults import DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_SCORE_BYTES, DEFAULT_STALL_AFTER, MIN_PREFILL_CHUNK

PROBE_CHUNK = 128
JOINT_TOKENS = 2 * PROBE_CHUNK  # the most tokens (rows x width) one shared prefill pass takes
JOINT_CONTEXT = 512  # the longest cache (cached tokens + remainder) a row of a shared pass may have
FIXED_COST_TOKENS = 512  # c0: a token's fixed cost expressed as attention over this many tokens of context


class PrefillPlanner:
    def __init__(
        self,
        heads: int,
        max_chunk: int = DEFAULT_PREFILL_CHUNK,
        seconds: float = DEFAULT_STALL_AFTER / 4,
        score_bytes: int | None = DEFAULT_PREFILL_SCORE_BYTES,
        first_chunk: int = PROBE_CHUNK,
    ):
        """``score_bytes=None`` lifts the memory limit (a GPU with fused attention)."""
        self.heads = max(1, heads)
        self.max_chunk = max(MIN_PREFILL_CHUNK, max_chunk)
        self.seconds = seconds
        self.score_bytes = score_bytes
        self.first_chunk = first_chunk
        self.rate: float | None = None  # seconds per (token x context token)
        self.sizes: list[int] = []
        self.share = None  # in a runner group, rank 0's size is every rank's (runner.group)

    def memory_limit(self, offset: int) -> int:
        if self.score_bytes is None:
            return self.max_chunk
        # heads * n * (offset + n) * 4 <= score_bytes, solved for n
        per = self.heads * 4
        n = (-offset + math.sqrt(offset * offset + 4 * self.score_bytes / per)) / 2
        return max(MIN_PREFILL_CHUNK, int(n))

    def time_limit(self, offset: int) -> int:
        if self.rate is None:
            return self.first_chunk
        u = offset + FIXED_COST_TOKENS
        # rate * n * (u + n/2) <= seconds, solved for n
        n = -u + math.sqrt(u * u + 2 * self.seconds / self.rate)
        return max(MIN_PREFILL_CHUNK, int(n))

    def next_chunk(self, offset: int, remaining: int) -> int:
        size = min(remaining, self.max_chunk, self.memory_limit(offset), self.time_limit(offset))
        if self.share is not None:
            size = self.share(size)
        self.sizes.append(size)
        return size

    def record(self, offset: int, size: int, seconds: float) -> None:
        """What the chunk of ``size`` tokens starting at ``offset`` took."""
        work = size * (offset + size / 2 + FIXED_COST_TOKENS)
        if work > 0 and seconds > 0:
            self.rate = seconds / work


def joint_groups(
    rows: list[tuple[int, int]], planner: PrefillPlanner, max_tokens: int = JOINT_TOKENS
) -> list[list[int]]:
    """Which waiting prompts share a prefill pass. ``rows``: (tokens already cached, tokens still to prefill) of
    each, in arrival order; returns groups of their indices, every one in exactly one group (a group
    of one prefills alone).

    A shared pass pads every row to the longest remainder (its width) and every cache to the longest one, so a
    group costs rows x width tokens (at most ``max_tokens``) and rows x heads x width x (longest cache + width)
    float32 attention scores (at most the planner's ``score_bytes``). Only a remainder of at most a first chunk,
    on a cache of at most ``JOINT_CONTEXT`` tokens with it, joins; a longer one prefills alone, chunk by chunk."""

    def fits(group: list[int]) -> bool:
        width = max(rows[i][1] for i in group)
        context = max(rows[i][0] for i in group) + width
        if len(group) * width > max_tokens:
            return False
        return planner.score_bytes is None or len(group) * planner.heads * width * context * 4 <= planner.score_bytes

    groups: list[list[int]] = []
    current: list[int] = []
    for i, (held, remaining) in enumerate(rows):
        if remaining > planner.first_chunk or held + remaining > JOINT_CONTEXT or not fits([i]):
            groups.append([i])
        elif fits(current + [i]):
            current.append(i)
        else:
            groups.append(current)
            current = [i]
    if current:
        groups.append(current)
    return groups
