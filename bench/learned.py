"""The learned drafters against the draft model, n-gram lookup and plain decoding, each configuration twice in one
run: issue #41's goals as ratios (on this CPU: a trained head >= 1.4x plain on SmolLM2's prose; on the pair, a
learned drafter >= 1.15x the draft model's speculation).

bench/speculation.py's tables (its prompts, decode-only tok/s summed over the prompts of a kind, greedy so every
configuration emits the same tokens), with every configuration listed twice (#1, #2) and the list run in turn on
each prompt, reversed on every other one: a machine that drifts during the run weighs on all alike, and the two
copies of one configuration say how far this run's noise reaches. The drafters are whatever models/heads and
models/block hold (``make drafter-heads-long``, ``make block-model``): each head's config says how it was trained.
"""

from __future__ import annotations

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine

from .block import BLOCK_DIR
from .head import HEADS, trained
from .speculation import ours, table


def twice(rows: list) -> list:
    """Each row twice, "#1" then "#2" (the plain row once: it is the base of the ratios)."""
    plain, others = rows[0], rows[1:]
    return [plain, *[(f"{label} #1", fn) for label, fn in others], *[(f"{label} #2", fn) for label, fn in others]]


def mean_rate(results: dict, label: str, kind: str) -> float:
    """A configuration's tok/s on ``kind``: the mean of its two copies (plain's one row)."""
    if label in results:
        return results[label][kind].rate
    return sum(results[f"{label} #{i}"][kind].rate for i in (1, 2)) / 2


def ratios(results: dict, mine: tuple[str, ...], bases: tuple[str, ...]) -> None:
    """The best of ``mine`` against the best of ``bases`` per kind of prompt, each the mean of its two copies."""
    for kind in results["ours, plain"]:
        best = max(mine, key=lambda label: mean_rate(results, label, kind))
        base = max(bases, key=lambda label: mean_rate(results, label, kind))
        ratio = mean_rate(results, best, kind) / mean_rate(results, base, kind)
        print(f"- {kind}: {best} {ratio:.2f}x {base}")
    print()


def run(pair_tokens: int = 256, smol_tokens: int = 128, prompts_per_kind: int = 2) -> None:
    missing = [
        str(folder)
        for folder in (HEADS / "default", HEADS / "smollm2", BLOCK_DIR / "default")
        if not (folder / "config.json").is_file()
    ]
    if missing:
        print(f"{missing[0]} is missing: make drafter-heads-long block-model\n")
        return
    print("\n".join(f"- {trained(name)}" for name in ("default", "smollm2")) + "\n")
    _pair(pair_tokens, prompts_per_kind)
    _smol(smol_tokens, prompts_per_kind)


def _pair(n: int, prompts_per_kind: int) -> None:
    pair = Engine.load(
        DEFAULT_TARGET,
        DEFAULT_DRAFT,
        RunnerSettings(prompt_cache=0, head=HEADS / "default", block=BLOCK_DIR / "default"),
    )
    rows = [
        ("ours, plain", lambda p: ours(pair, p, n, False, drafter="none")),
        ("draft model, adaptive", lambda p: ours(pair, p, n, False, drafter="model")),
        ("draft model, k = 1", lambda p: ours(pair, p, n, False, drafter="model", num_draft_tokens=1)),
        ("draft model, k = 3", lambda p: ours(pair, p, n, False, drafter="model", num_draft_tokens=3)),
        ("head, adaptive", lambda p: ours(pair, p, n, False, drafter="head")),
        ("head, k = 1", lambda p: ours(pair, p, n, False, drafter="head", num_draft_tokens=1)),
        ("head, k = 3", lambda p: ours(pair, p, n, False, drafter="head", num_draft_tokens=3)),
        ("block, adaptive", lambda p: ours(pair, p, n, False, drafter="block")),
        ("block, k = 3", lambda p: ours(pair, p, n, False, drafter="block", num_draft_tokens=3)),
    ]
    title = "default pair: learned drafters vs the draft model, each twice"
    results = table(title, pair, n, False, twice(rows), prompts_per_kind)
    print("Goal: a learned drafter >= 1.15x the draft model's speculation: its adaptive depth, then its best row.\n")
    learned = ("head, adaptive", "head, k = 1", "head, k = 3", "block, adaptive", "block, k = 3")
    ratios(results, learned, ("draft model, adaptive",))
    # k = 3 was the draft model's best fixed depth on the Xeon, k = 1 on the EPYC (two rows cost about one there).
    ratios(results, learned, ("draft model, adaptive", "draft model, k = 1", "draft model, k = 3"))


def _smol(n: int, prompts_per_kind: int) -> None:
    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0, head=HEADS / "smollm2"))
    rows = [
        ("ours, plain", lambda p: ours(smol, p, n, True, drafter="none")),
        ("n-gram, adaptive", lambda p: ours(smol, p, n, True, drafter="ngram")),
        ("head, adaptive", lambda p: ours(smol, p, n, True, drafter="head")),
        ("head, k = 1", lambda p: ours(smol, p, n, True, drafter="head", num_draft_tokens=1)),
        ("head, k = 2", lambda p: ours(smol, p, n, True, drafter="head", num_draft_tokens=2)),
    ]
    title = f"SmolLM2-135M-Instruct in {smol.target.compute_dtype}: its head, each twice"
    results = table(title, smol, n, True, twice(rows), prompts_per_kind)
    print("Goal: the head >= 1.4x plain on prose.\n")
    heads = ("head, adaptive", "head, k = 1", "head, k = 2")
    for base in ("ours, plain", "n-gram, adaptive"):
        ratios(results, heads, (base,))
