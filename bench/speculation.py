"""Decode speed by drafter and depth, against mlx-lm's own generators, on prose and on input-grounded prompts.

In one run, in-process (the runner adds nothing measurable, see the runner
table): our plain decoding, fixed depths k = 1..6, the adaptive depth (the
default), each drafter, and mlx-lm's ``generate_step`` and
``speculative_generate_step`` on the same checkpoints in the same dtype, but
without our one-row padding (``runner.loading.row_padding``), as mlx-lm runs them. Greedy throughout, so
every configuration emits the same tokens. tok/s counts decode only (from the
first token to the last) and is summed over the prompts of a kind. The
configurations take turns on each prompt, so the machine's drift is shared.

The default pair continues raw text for a fixed number of tokens. The instruct
model answers chat messages and stops at the end of its answer (up to a
limit): what follows an ignored end of turn is an invented next conversation,
which has nothing to copy from the input and is not what a user waits for.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.loading.load import load_model
from runner.request import GenerationRequest, end_of_turn_ids

PROSE = (
    "The for statement is used to iterate over the elements of a sequence",
    "A class definition defines a class object",
)
CODE = """def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)
"""
DOCUMENT = (
    "The while statement is used for repeated execution as long as an expression is true. "
    "A break statement executed in the first suite terminates the loop without executing the else "
    "clause's suite. A continue statement executed in the first suite skips the rest of the suite and "
    "goes back to testing the expression."
)
ITEMS = [
    "for statements iterate over sequences",
    "while statements repeat while a condition holds",
    "break leaves the innermost loop",
    "continue goes on with the next iteration",
    "else runs when the loop was not broken",
]
# The default pair continues raw text; the instruct model gets the same tasks as chat messages.
GROUNDED_TEXT = (
    f"Rename total to running_sum in this code.\n\n{CODE}\nThe same code with running_sum:\n\ndef mean(values):\n",
    f"{DOCUMENT}\n\nThe sentences above, one a line:\n\nThe while statement",
    "Repeat this list, with 'loop' in place of 'statement':\n- " + "\n- ".join(ITEMS) + "\n\nThe new list:\n- for",
)
GROUNDED_CHAT = (
    f"Rename the variable total to running_sum in this Python code and show the whole function.\n\n{CODE}",
    f"Copy the sentences of this text that mention the else clause or the break statement:\n\n{DOCUMENT}",
    "Repeat this list, writing 'loop' in place of 'statements':\n- " + "\n- ".join(ITEMS),
)


@dataclass
class Tally:
    """Decode-only counts of one configuration, summed over prompts."""

    generated: int = 0  # tokens after the first (which comes with the prefill)
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def __add__(self, other: Tally) -> Tally:
        return Tally(
            self.generated + other.generated,
            self.seconds + other.seconds,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
        )

    @property
    def rate(self) -> float:
        return self.generated / self.seconds

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")


def ours(engine: Engine, prompt: str, tokens: int, chat: bool, **fields) -> Tally:
    """One prompt: ``tokens`` tokens, or (``chat``) to the end of the answer, at most ``tokens``."""
    request = (
        GenerationRequest(messages=(("user", prompt),), **fields)
        if chat
        else GenerationRequest(prompt=prompt, **fields)
    )
    for last in engine.generate(
        GenerationRequest(**{**request.__dict__, "max_tokens": tokens, "ignore_eos": not chat, "cache_prompt": False})
    ):
        pass
    s = last.stats
    return Tally(*after_first_token(s), s.drafted, s.accepted)


def after_first_token(s) -> tuple[int, float]:
    """(tokens, seconds) of a generation's decoding after its first token (prefill and first round excluded)."""
    return s.generated_tokens - 1, s.decode_seconds - (s.time_to_first_token - s.prefill_seconds)


def as_mlx_lm_runs_it(engine: Engine) -> tuple:
    """(target, draft): the engine's checkpoints in its dtype, without runner.loading.row_padding and runner.loading.fusion
    (mlx-lm's layers as they ship)."""
    return tuple(
        load_model(loaded.path, loaded.dtype, row_padding=False, fuse=False).model if loaded else None
        for loaded in (engine.target, engine.draft)
    )


def reference(engine: Engine, models: tuple, prompt: str, tokens: int, chat: bool, k: int) -> Tally:
    """mlx-lm's generators on ``models`` (``as_mlx_lm_runs_it``), one prompt tokenized by ``engine``; timed
    from the first token."""
    target, draft = models
    ends = frozenset(engine.tokenizer.eos_token_ids) | end_of_turn_ids(engine.tokenizer) if chat else frozenset()
    ids = (
        engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        if chat
        else engine.tokenizer.encode(prompt)
    )
    if k == 0:
        steps = generate_step(mx.array(ids), target, max_tokens=tokens)
    else:
        steps = speculative_generate_step(mx.array(ids), target, draft, num_draft_tokens=k, max_tokens=tokens)
    generated, start = 0, None
    for out in steps:  # (token, logprobs[, from_draft])
        start = start or time.perf_counter()
        generated += 1
        if int(out[0]) in ends:
            break
    return Tally(generated - 1, time.perf_counter() - start)


def plain_rows(engine: Engine, as_mlx_lm: tuple, tokens: int, chat: bool) -> list:
    """The two rows every table has first: our plain decoding and mlx-lm's ``generate_step``."""
    return [
        ("ours, plain", lambda p: ours(engine, p, tokens, chat, drafter="none")),
        ("mlx-lm generate_step", lambda p: reference(engine, as_mlx_lm, p, tokens, chat, 0)),
    ]


def table(title: str, engine: Engine, tokens: int, chat: bool, rows: list, prompts_per_kind: int = 3) -> dict:
    kinds = {
        "prose": PROSE[:prompts_per_kind],
        "input-grounded": (GROUNDED_CHAT if chat else GROUNDED_TEXT)[:prompts_per_kind],
    }
    length = f"greedy answers of up to {tokens} tokens" if chat else f"{tokens} greedy tokens per prompt"
    counts = f"{len(kinds['prose'])} prose prompts, {len(kinds['input-grounded'])} input-grounded"
    print(f"## speculation: {title}, {length} ({counts})\n")
    print("| decoder | " + " | ".join(f"{kind} tok/s | vs our plain | acceptance" for kind in kinds) + " |")
    print("| --- | " + " | ".join("--- | --- | ---" for _ in kinds) + " |")
    # Warm-up: every configuration once, untimed. MLX's CUDA backend compiles a kernel the first time it
    # meets it (seconds); without this, whichever configuration came first paid for the others (docs/gpu.md).
    for _, run in rows:
        run(PROSE[0])
    # Every configuration runs each prompt in turn (in the opposite order for every other prompt), so a
    # machine that slows down or speeds up during the run weighs on all of them alike.
    results = {label: {kind: Tally() for kind in kinds} for label, _ in rows}
    turn = 0
    for kind, prompts in kinds.items():
        for prompt in prompts:
            for label, run in rows if turn % 2 == 0 else rows[::-1]:
                results[label][kind] += run(prompt)
            turn += 1
            print(f"speculation: {title}: {kind} prompt {turn} done", file=sys.stderr, flush=True)
    base = results["ours, plain"]
    for label, by_kind in results.items():
        cells = []
        for kind, tally in by_kind.items():
            shown = "-" if tally.acceptance != tally.acceptance else f"{tally.acceptance:.2f}"
            cells.append(f"{tally.rate:.1f} | {tally.rate / base[kind].rate:.2f}x | {shown}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    return results


def run(
    pair_tokens: int = 256,
    smol_tokens: int = 160,
    depths=range(1, 7),
    ngram_depths=(1, 2, 4, 6),
    reference_depths=None,
    prompts_per_kind: int = 3,
    tables: tuple = ("pair", "smol"),
    figure: str | None = "speculation.png",
) -> None:
    """Both tables (or those named in ``tables``); bench/device.py runs it with other sizes (deeper on a GPU,
    shorter on a quick CPU run) and one table per step, so a step out of time loses only its own."""
    measured = {}
    if "pair" in tables:
        measured["default pair"] = _pair_table(pair_tokens, depths, reference_depths, prompts_per_kind)
    if "smol" in tables:
        measured["SmolLM2-135M"] = _smol_table(smol_tokens, ngram_depths, prompts_per_kind)
    if figure:
        path = speed_up_figure(measured, figure)
        print(f"![Speed-up over plain decoding against draft depth, per decoder](figures/{path.name})\n")


DEPTH = re.compile(r"^(?P<decoder>.+), k = (?P<k>\d+)$")


def speed_up_figure(measured: dict, name: str) -> Path:
    """One panel per model and prompt kind: each fixed-depth decoder's speed-up over our plain decoding against
    its depth k, the adaptive decoders as dashed levels, 1.0 (plain) as the floor to beat."""
    from .figures import FIGURES, line_figure

    panels = []
    for model, results in measured.items():
        base = results["ours, plain"]
        for kind in base:
            series: dict[str, tuple[list, list]] = {}
            levels = [("plain (ours)", 1.0)]
            for label, by_kind in results.items():
                ratio = by_kind[kind].rate / base[kind].rate
                depth = DEPTH.match(label)
                if depth:
                    xs, ys = series.setdefault(depth["decoder"], ([], []))
                    xs.append(int(depth["k"]))
                    ys.append(ratio)
                elif "adaptive" in label or label == "mlx-lm generate_step":
                    levels.append((label.replace(" (default)", ", default"), ratio))
            panels.append(
                {
                    "title": f"{model}, {kind} prompts",
                    "x": "draft depth k",
                    "y": "speed-up over plain decoding",
                    "series": [(decoder, xs, ys) for decoder, (xs, ys) in series.items()],
                    "levels": levels,
                }
            )
    return line_figure(
        FIGURES / name, "Speculative decoding: speed-up against draft depth", panels, columns=min(2, len(panels))
    )


def _pair_table(pair_tokens: int, depths, reference_depths, prompts_per_kind: int) -> None:
    pair = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))
    pair_as_mlx_lm = as_mlx_lm_runs_it(pair)
    n = pair_tokens
    rows = plain_rows(pair, pair_as_mlx_lm, n, False)
    rows += [
        (f"ours, draft model, k = {k}", lambda p, k=k: ours(pair, p, n, False, drafter="model", num_draft_tokens=k))
        for k in depths
    ]
    rows += [
        (f"mlx-lm speculative_generate_step, k = {k}", lambda p, k=k: reference(pair, pair_as_mlx_lm, p, n, False, k))
        for k in (depths if reference_depths is None else reference_depths)
    ]
    rows += [
        ("ours, n-gram, adaptive", lambda p: ours(pair, p, n, False, drafter="ngram")),
        ("ours, draft model, adaptive (default)", lambda p: ours(pair, p, n, False)),
    ]
    return table("default pair (draft model)", pair, n, False, rows, prompts_per_kind)


def _smol_table(smol_tokens: int, ngram_depths, prompts_per_kind: int) -> None:
    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0))
    smol_as_mlx_lm = as_mlx_lm_runs_it(smol)
    n = smol_tokens
    rows = plain_rows(smol, smol_as_mlx_lm, n, True)
    rows += [
        (f"ours, n-gram, k = {k}", lambda p, k=k: ours(smol, p, n, True, drafter="ngram", num_draft_tokens=k))
        for k in ngram_depths
    ]
    rows += [("ours, n-gram, adaptive (default)", lambda p: ours(smol, p, n, True))]
    dtype = smol.target.compute_dtype
    return table(
        f"SmolLM2-135M-Instruct in {dtype} (no draft model: n-gram lookup)", smol, n, True, rows, prompts_per_kind
    )
