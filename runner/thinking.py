"""The reasoning of a model that thinks in a block (``<think> ... </think>``: common.reasoning), as a constraint.

``ThinkingPhase`` stands where a request's ``runner.constraint.Constraint`` stands (the decoders take it the
same way) and follows the answer through three phases, by the block's marker tokens:

- ``before``: the answer has not opened a block. A token that is not the start marker begins the answer; with a
  grammar, only the grammar's tokens and the start marker are allowed here.
- ``thinking``: free, no mask (the grammar does not hold the reasoning). At the budget, the end marker is the only
  token allowed, so it is forced: fed as a certain draft, as a grammar's forced tokens are (issue #21).
- ``answer``: the grammar (JSON schema, regex, tool calls), if any, from its start. Without one the phase is
  ``spent`` and the decoder drops it (its rounds pipeline again).

Everything it consumed it can take back (``rollback``): a speculative round's rejected drafts.
"""

from __future__ import annotations

import numpy as np

from .constraint import allows, forced_tokens, only_token


class ThinkingPhase:
    def __init__(
        self,
        inner,
        start_ids: list[int],
        end_ids: list[int],
        budget: int | None,
        vocab_size: int,
        opened: bool = False,
    ):
        """``inner``: the request's grammar (a Constraint) or None; ``start_ids``/``end_ids``: the markers'
        tokens; ``budget``: the most reasoning tokens (None: unbounded); ``opened``: the prompt opened the
        block."""
        self.inner = inner
        self.start_ids, self.end_ids = list(start_ids), list(end_ids)
        self.budget = budget
        self.vocab_size = vocab_size
        self.forcing = True if inner is None else inner.forcing
        self.state = "thinking" if opened else "before"
        self.count = 0  # reasoning tokens so far (the end marker's not among them)
        self.marker = 0  # tokens of the marker being written (a prefix of start_ids or end_ids)
        self._history: list[tuple[str, int, int, bool]] = []  # per consumed token: the state before, and fed inner

    # -- what may come next ---------------------------------------------------------------------------------

    def _only(self, token: int) -> np.ndarray:
        mask = np.zeros((self.vocab_size + 7) // 8, dtype=np.uint8)
        mask[token // 8] = 1 << (token % 8)
        return mask

    def mask(self) -> np.ndarray | None:
        """The allowed tokens here (a packed bitmask), or None where any token may come."""
        if self.state == "answer":
            return self.inner.mask() if self.inner is not None else None
        if self.state == "thinking":
            if self.marker or (self.budget is not None and self.count >= self.budget):
                return self._only(self.end_ids[self.marker])  # the end marker, whole, once it started or is due
            return None
        if self.marker:  # a start marker of several tokens, begun: it is finished
            return self._only(self.start_ids[self.marker])
        if self.inner is None:
            return None
        mask = self.inner.mask().copy()
        first = self.start_ids[0]
        if first // 8 < mask.size:
            mask[first // 8] |= 1 << (first % 8)
        return mask

    @staticmethod
    def allows(mask: np.ndarray | None, token: int) -> bool:
        return allows(mask, token)

    def only(self, mask: np.ndarray | None) -> int | None:
        """The one token ``mask`` allows, if it allows exactly one."""
        return only_token(mask, self.vocab_size)

    def forced(self, limit: int, stop_ids: frozenset[int]) -> tuple[list[int], np.ndarray | None]:
        """The tokens forced from here (consumed): the end marker at the budget, then the grammar's own; at most
        ``limit``, none in ``stop_ids``; and the mask after them."""
        return forced_tokens(self, limit, stop_ids)

    # -- following the answer -------------------------------------------------------------------------------

    def consume(self, token: int) -> None:
        fed = False
        self._history.append((self.state, self.count, self.marker, fed))
        if self.state == "before":
            if token == self.start_ids[self.marker]:
                self.marker += 1
                if self.marker == len(self.start_ids):
                    self.state, self.marker = "thinking", 0
            else:
                self.state, self.marker = "answer", 0
        elif self.state == "thinking":
            if token == self.end_ids[self.marker]:
                self.marker += 1
                if self.marker == len(self.end_ids):
                    self.state, self.marker = "answer", 0
                return
            self.count += 1 + self.marker  # a marker's start that was not one after all: reasoning
            self.marker = 0
            return
        elif self.inner is not None and not self.inner.finished:
            self.inner.consume(token)
            fed = True
        if self.state == "answer" and self._history[-1][0] == "before" and self.inner is not None:
            self.inner.consume(token)  # the answer's first token
            fed = True
        self._history[-1] = self._history[-1][:3] + (fed,)

    def rollback(self, count: int) -> None:
        fed = 0
        for _ in range(min(count, len(self._history))):
            self.state, self.count, self.marker, inner = self._history.pop()
            fed += inner
        if fed:
            self.inner.rollback(fed)

    @property
    def finished(self) -> bool:
        """The grammar of the answer is complete."""
        return self.state == "answer" and self.inner is not None and self.inner.finished

    @property
    def spent(self) -> bool:
        """Nothing more to hold: the answer has started and has no grammar."""
        return self.state == "answer" and self.inner is None

    @property
    def reasoning(self) -> bool:
        return self.state == "thinking"
