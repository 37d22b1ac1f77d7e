"""When a generation stops: end-of-sequence tokens, stop strings and max_tokens, in one unit.

``StoppingCriteria`` sees every token the decode loop is about to emit, in
order, and says whether it is emitted, what text it adds and whether the
generation ends with it. An end-of-sequence token ends the generation and is
not emitted; a stop string ends it with the token that completed it (its text
cut before the stop string, see ``runner.text``); the token that reaches
``max_tokens`` ends it with finish reason ``length``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.requests import FinishReason

from .text import TextStream


@dataclass(frozen=True)
class Decision:
    emit: bool
    text: str
    finish_reason: FinishReason | None  # STOP, LENGTH or None


class StoppingCriteria:
    def __init__(
        self,
        tokenizer,
        eos_ids: frozenset[int] | set[int],
        stop: tuple[str, ...],
        max_tokens: int,
        answer_start=None,
        keep_special: bool = False,
    ):
        """``answer_start``: where the answer starts in the text of one that may reason first (stop strings apply
        to the answer only: runner.text.TextStream); ``keep_special``: special tokens are text (harmony's)."""
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.text = TextStream(tokenizer, stop, answer_start, keep_special)
        self.count = 0  # tokens emitted

    def __call__(self, token: int) -> Decision:
        if token in self.eos_ids:
            return Decision(False, "", FinishReason.STOP)
        delta = self.text.add(token)
        self.count += 1
        if self.text.stopped:
            return Decision(True, delta, FinishReason.STOP)
        if self.count >= self.max_tokens:
            return Decision(True, delta, FinishReason.LENGTH)
        return Decision(True, delta, None)

    def prime(self, tokens, sent: int) -> None:
        """A resumed answer (``TextStream.prime``): its tokens so far, ``sent`` characters of their text sent."""
        self.text.prime(tokens, sent)

    def finish(self) -> str:
        """The held-back tail of the text, once the generation is over."""
        return self.text.finish()
