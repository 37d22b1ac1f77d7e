"""Repetition penalties: OpenAI's ``presence_penalty`` and ``frequency_penalty``, and ``repetition_penalty``
(Hugging Face's, mlx-lm's and vLLM's name), applied on the same seam as ``logit_bias`` (``Decoder.process``).

- presence: ``presence`` is subtracted from the logit of every token the answer holds already;
- frequency: ``frequency`` times the number of times the answer holds it;
- repetition: a logit of a token the prompt or the answer holds is divided by ``repetition`` when positive,
  multiplied when negative (CTRL's rule, as Hugging Face and vLLM apply it).

Presence and frequency count the answer's tokens, as vLLM does; repetition looks at the prompt too.

The counts live on the device and grow lazily: a pipelined round queues the next forward pass and its choice
from a token the host has not read yet, and the choice must see that token counted, so ``count`` takes the
device's token as it is (no sync). A verify pass chooses several positions at once: row ``i`` sees the
counts plus the tokens fed before it in the round (``apply``'s ``before``), so a drafted repetition is
penalised exactly as it would be decoded one token at a time - speculation and batching keep the same
greedy output.
"""

from __future__ import annotations

import mlx.core as mx


class Penalties:
    def __init__(self, vocab: int, prompt_ids, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0):
        self.vocab = vocab
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.counts = mx.zeros(vocab, dtype=mx.float32)  # the answer's tokens
        self.in_prompt = (
            mx.zeros(vocab, dtype=mx.bool_).at[mx.array(list(set(prompt_ids)))].add(True) if repetition != 1.0 else None
        )

    @staticmethod
    def wanted(presence: float, frequency: float, repetition: float) -> bool:
        return bool(presence or frequency or repetition != 1.0)

    def count(self, tokens) -> None:
        """The answer grew by ``tokens``: a list of ids, or a token still on the device (lazy)."""
        if isinstance(tokens, list):
            if not tokens:
                return
            tokens = mx.array(tokens, dtype=mx.uint32)
        self.counts = self.counts.at[tokens.reshape(-1)].add(1.0)

    def apply(self, rows: mx.array, before=None) -> mx.array:
        """``rows`` (vocab,) or (n, vocab) penalised; row ``i`` of n also sees ``before[:i]`` (the tokens fed
        ahead of it in this round and not counted yet: a list or a device array of n - 1 ids, or more)."""
        single = rows.ndim == 1
        rows2 = rows[None] if single else rows
        n = rows2.shape[0]
        counts = mx.broadcast_to(self.counts[None], (n, self.vocab))
        if before is not None and n > 1:
            ahead = before if isinstance(before, mx.array) else mx.array(before, dtype=mx.uint32)
            ahead = ahead.reshape(-1)[: n - 1]
            steps = mx.zeros((n, self.vocab), dtype=mx.float32)
            steps = steps.at[mx.arange(1, ahead.size + 1), ahead].add(1.0)  # row j+1 gains the j-th token
            counts = counts + mx.cumsum(steps, axis=0)
        dtype = rows2.dtype
        out = rows2.astype(mx.float32)
        if self.repetition != 1.0:
            seen = (counts > 0) | self.in_prompt[None]
            out = mx.where(seen, mx.where(out > 0, out / self.repetition, out * self.repetition), out)
        if self.frequency:
            out = out - self.frequency * counts
        if self.presence:
            out = out - self.presence * (counts > 0).astype(mx.float32)
        out = out.astype(dtype)
        return out[0] if single else out
