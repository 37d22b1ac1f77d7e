"""The reasoning of a model that thinks in a block, held as a constraint (runner/thinking.py): free while it thinks,
its end forced at the budget, a grammar on the answer only, and everything taken back on a rollback. Tokens here
are plain numbers (no model): 1 opens the block, 2 closes it, the grammar is a stand-in that allows only even
tokens and is complete after 3 of them (it stands for runner.constraint.Constraint, whose real grammars
tests/test_reasoning.py drives end to end)."""

from __future__ import annotations

import numpy as np

from runner.thinking import ThinkingPhase

VOCAB = 16
START, END = 1, 2


class EvenTokens:
    """A grammar stand-in: even tokens only, complete after three."""

    forcing = True

    def __init__(self):
        self.taken: list[int] = []

    def mask(self):
        allowed = np.zeros(VOCAB, dtype=bool)
        allowed[::2] = True
        return np.packbits(allowed, bitorder="little")

    def consume(self, token):
        assert token % 2 == 0, f"the grammar was fed {token}"
        self.taken.append(token)

    def rollback(self, count):
        del self.taken[len(self.taken) - count :]

    @property
    def finished(self):
        return len(self.taken) >= 3


def allowed(phase) -> set[int]:
    mask = phase.mask()
    return set(range(VOCAB)) if mask is None else {t for t in range(VOCAB) if phase.allows(mask, t)}


def test_free_while_it_thinks_the_grammar_after():
    grammar = EvenTokens()
    phase = ThinkingPhase(grammar, [START], [END], None, VOCAB)
    assert allowed(phase) == {t for t in range(VOCAB) if t % 2 == 0} | {START}  # the grammar, or a block
    for token in (START, 5, 7, 9):
        phase.consume(token)
    assert allowed(phase) == set(range(VOCAB)) and phase.count == 3 and grammar.taken == []
    phase.consume(END)
    assert allowed(phase) == {t for t in range(VOCAB) if t % 2 == 0} and not phase.finished
    for token in (4, 6, 8):
        phase.consume(token)
    assert grammar.taken == [4, 6, 8] and phase.finished


def test_the_budgets_end_is_forced_then_the_grammars_own_tokens():
    phase = ThinkingPhase(None, [START], [END], 2, VOCAB, opened=True)
    phase.consume(5)
    assert phase.forced(8, frozenset()) == ([], None)  # one more may come
    phase.consume(7)
    tokens, mask = phase.forced(8, frozenset())
    assert tokens == [END] and mask is None and phase.spent  # no grammar after it: nothing more to hold
    assert ThinkingPhase(None, [START], [END], 0, VOCAB, opened=True).forced(8, frozenset({END}))[0] == []


def test_a_rollback_takes_back_the_phase_and_the_grammar():
    grammar = EvenTokens()
    phase = ThinkingPhase(grammar, [START], [END], None, VOCAB, opened=True)
    phase.consume(5)
    for token in (END, 4, 6):  # drafts: the end of the block and two of the answer
        phase.consume(token)
    assert phase.state == "answer" and grammar.taken == [4, 6]
    phase.rollback(3)
    assert phase.state == "thinking" and phase.count == 1 and grammar.taken == []
    phase.consume(9)
    assert phase.count == 2


def test_a_marker_of_several_tokens_is_finished_once_begun():
    phase = ThinkingPhase(None, [START], [3, 4], 1, VOCAB, opened=True)
    phase.consume(5)
    tokens, _ = phase.forced(8, frozenset())
    assert tokens == [3, 4] and phase.state == "answer"
