"""Block drafting (runner/drafting/block.py) against plain decoding, the draft model and n-gram lookup, in one run.

bench/speculation.py's tables (its prompts, its alternation of configurations on each prompt, decode-only tok/s
summed over the prompts of a kind), with the block drafters models/train_block.py trains (``make block-model``):
on the default pair (the draft model is the default there) and on SmolLM2-135M-Instruct (no draft model: n-gram
is its default). Greedy throughout, so every configuration emits the same tokens. Then the block drafter's
acceptance by depth, from its rounds at k = 6 in the same run: a_i, the share of rounds that reached draft i
(every draft before it kept) where draft i was kept too, and the share of rounds that kept at least i drafts.
"""

from __future__ import annotations

from pathlib import Path

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.drafting.block import BlockDrafter
from runner.engine import Engine

from .speculation import PROSE, ours, table

BLOCK_DIR = Path(__file__).resolve().parents[1] / "models" / "block"
DEPTHS = (2, 3, 4, 6)


class Verdicts:
    """The block drafter's (drafted, kept) per round while ``kind`` is set, by kind of prompt."""

    def __init__(self):
        self.kind: str | None = None
        self.rounds: dict[str, list[tuple[int, int]]] = {}

    def __enter__(self):
        self._accepted = BlockDrafter.accepted
        verdicts = self

        def recording(drafter, proposal, kept):
            if verdicts.kind is not None:
                verdicts.rounds.setdefault(verdicts.kind, []).append((proposal.size, kept))
            return verdicts._accepted(drafter, proposal, kept)

        BlockDrafter.accepted = recording
        return self

    def __exit__(self, *exc):
        BlockDrafter.accepted = self._accepted

    def run(self, prompt: str, fn):
        self.kind = "prose" if prompt in PROSE else "input-grounded"
        try:
            return fn(prompt)
        finally:
            self.kind = None

    def table(self, title: str) -> None:
        print(f"## block drafter: acceptance by depth, {title} (its rounds at k = 6; a_i / kept at least i)\n")
        print("| prompts | rounds | " + " | ".join(f"draft {i}" for i in range(1, 7)) + " | drafts kept per round |")
        print("| --- | --- | " + " | ".join("---" for _ in range(6)) + " | --- |")
        for kind, rounds in self.rounds.items():
            full = [kept for size, kept in rounds if size == 6]
            cells = []
            for i in range(1, 7):
                reached = sum(1 for kept in full if kept >= i - 1)
                hit = sum(1 for kept in full if kept >= i)
                cells.append(f"{hit / reached:.2f} / {hit / len(full):.2f}" if reached else "-")
            print(f"| {kind} | {len(full)} | " + " | ".join(cells) + f" | {sum(full) / max(1, len(full)):.2f} |")
        print()


def block_rows(engine: Engine, tokens: int, chat: bool, verdicts: Verdicts, depths=DEPTHS) -> list:
    def fixed(k):
        run = lambda p: ours(engine, p, tokens, chat, drafter="block", num_draft_tokens=k)  # noqa: E731
        return (lambda p: verdicts.run(p, run)) if k == 6 else run

    rows = [(f"ours, block drafter, k = {k}", fixed(k)) for k in depths]
    return rows + [("ours, block drafter, adaptive", lambda p: ours(engine, p, tokens, chat, drafter="block"))]


def run(pair_tokens: int = 256, smol_tokens: int = 96, prompts_per_kind: int = 2) -> None:
    if not (BLOCK_DIR / "smollm2").is_dir():
        print("models/block is missing: make block-model\n")
        return
    _pair(pair_tokens, prompts_per_kind)
    _smol(smol_tokens, prompts_per_kind)


def _pair(n: int, prompts_per_kind: int) -> None:
    pair = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0, block=BLOCK_DIR / "default"))
    with Verdicts() as verdicts:
        rows = [
            ("ours, plain", lambda p: ours(pair, p, n, False, drafter="none")),
            ("ours, draft model, adaptive (default)", lambda p: ours(pair, p, n, False, drafter="model")),
            ("ours, n-gram, adaptive", lambda p: ours(pair, p, n, False, drafter="ngram")),
            *block_rows(pair, n, False, verdicts),
        ]
        title = f"default pair with its block drafter, {pair.target.compute_dtype}"
        table(title, pair, n, False, rows, prompts_per_kind)
    verdicts.table("default pair's target")


def _smol(n: int, prompts_per_kind: int) -> None:
    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0, block=BLOCK_DIR / "smollm2"))
    with Verdicts() as verdicts:
        rows = [
            ("ours, plain", lambda p: ours(smol, p, n, True, drafter="none")),
            (
                "ours, n-gram, adaptive (the default without a block drafter)",
                lambda p: ours(smol, p, n, True, drafter="ngram"),
            ),
            *block_rows(smol, n, True, verdicts, depths=(3, 6)),
        ]
        title = f"SmolLM2-135M-Instruct with its block drafter, {smol.target.compute_dtype}"
        table(title, smol, n, True, rows, prompts_per_kind)
    verdicts.table("SmolLM2-135M-Instruct")
