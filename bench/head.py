"""Drafter heads trained here (runner/drafting/head.py, ``make drafter-heads``) against plain decoding, the draft model and
n-gram lookup, on the default pair and on SmolLM2, prose and input-grounded prompts (bench/speculation.py's).

In one run, in-process, the configurations taking turns on each prompt (``bench.speculation.table``): our plain
decoding, the draft model with its adaptive depth (the pair's default), n-gram lookup with its adaptive depth, and
the head at fixed depths k = 1..6 (its acceptance at each depth) and with the adaptive depth. Greedy throughout:
every configuration emits the same tokens. The heads are whatever ``models/heads`` holds: their config.json says
how each was trained (``drafter_head.trained``).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine

from .speculation import ours, table

HEADS = Path(__file__).resolve().parents[1] / "models" / "heads"


def head_rows(engine: Engine, tokens: int, chat: bool, depths) -> list:
    rows = [
        (f"ours, head, k = {k}", lambda p, k=k: ours(engine, p, tokens, chat, drafter="head", num_draft_tokens=k))
        for k in depths
    ]
    return rows + [("ours, head, adaptive", lambda p: ours(engine, p, tokens, chat, drafter="head"))]


def trained(name: str) -> str:
    info = json.loads((HEADS / name / "config.json").read_text())["drafter_head"]
    t = info["trained"]
    vocab = f"a reduced vocabulary of {info['draft_vocab']} tokens" if info["draft_vocab"] else "the full vocabulary"
    return (
        f"head {name}: {t['prompts']} prompts x {t['tokens']} tokens ({t['positions']} positions), {t['epochs']} "
        f"epochs, unroll {t['unroll']}, {vocab}; data {t['data_seconds']} s, training {t['train_seconds']} s; "
        f"held-out first-draft agreement {t['held_out_agreement']:.3f}"
    )


def run(pair_tokens: int = 256, smol_tokens: int = 160, depths=range(1, 7), prompts_per_kind: int = 3) -> None:
    missing = [name for name in ("default", "smollm2") if not (HEADS / name / "config.json").is_file()]
    if missing:
        print(f"models/heads/{missing[0]} is missing: make drafter-heads\n")
        return
    print("\n".join(f"- {trained(name)}" for name in ("default", "smollm2")) + "\n")
    _pair_table(pair_tokens, depths, prompts_per_kind)
    _smol_table(smol_tokens, depths, prompts_per_kind)


def _pair_table(n: int, depths, prompts_per_kind: int) -> None:
    pair = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0, head=HEADS / "default"))
    rows = [
        ("ours, plain", lambda p: ours(pair, p, n, False, drafter="none")),
        ("ours, draft model, adaptive (default)", lambda p: ours(pair, p, n, False)),
        ("ours, n-gram, adaptive", lambda p: ours(pair, p, n, False, drafter="ngram")),
        *head_rows(pair, n, False, depths),
    ]
    table("default pair: the head against the draft model", pair, n, False, rows, prompts_per_kind)


def _smol_table(n: int, depths, prompts_per_kind: int) -> None:
    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0, head=HEADS / "smollm2"))
    rows = [
        ("ours, plain", lambda p: ours(smol, p, n, True, drafter="none")),
        ("ours, n-gram, adaptive", lambda p: ours(smol, p, n, True, drafter="ngram")),
        *head_rows(smol, n, True, depths),
    ]
    table(f"SmolLM2-135M-Instruct in {smol.target.compute_dtype}: the head", smol, n, True, rows, prompts_per_kind)
