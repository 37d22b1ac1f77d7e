"""Decode speed by drafter and depth, against mlx-lm's own generators, on prose and on input-grounded prompts.

In one run, in-process (the runner adds nothing measurable, see the runner
table): our plain decoding, fixed depths k = 1..6, the adaptive depth (the
default), each drafter, and mlx-lm's ``generate_step`` and
``speculative_generate_step`` on the same checkpoints in the same dtype, but
without our one-row padding (``runner.row_padding``), as mlx-lm runs them. Greedy throughout, so
every configuration emits the same tokens. tok/s counts decode only (from the
first token to the last) and is summed over the prompts of a kind.

The default pair continues raw text for a fixed number of tokens. The instruct
model answers chat messages and stops at the end of its answer (up to a
limit): what follows an ignored end of turn is an invented next conversation,
which has nothing to copy from the input and is not what a user waits for.
"""

from __future__ import annotations

import time

import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step

from runner.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from runner.engine import Engine, EngineSettings
from runner.loading import load_model
from runner.request import GenerationRequest, end_of_turn_ids

PROSE = (
    "The for statement is used to iterate over the elements of a sequence",
    "A class definition defines a class object",
)
CODE = '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)
'''
DOCUMENT = ("The while statement is used for repeated execution as long as an expression is true. "
            "A break statement executed in the first suite terminates the loop without executing the else "
            "clause's suite. A continue statement executed in the first suite skips the rest of the suite and "
            "goes back to testing the expression.")
ITEMS = ["for statements iterate over sequences", "while statements repeat while a condition holds",
         "break leaves the innermost loop", "continue goes on with the next iteration",
         "else runs when the loop was not broken"]
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


def ours(engine: Engine, prompts, tokens: int, chat: bool, **fields) -> tuple[float, float]:
    """(tok/s, acceptance) over ``prompts``: ``tokens`` each, or (``chat``) to the end of the answer, at most
    ``tokens``."""
    generated = seconds = drafted = accepted = 0
    for prompt in prompts:
        request = (GenerationRequest(messages=(("user", prompt),), **fields) if chat
                   else GenerationRequest(prompt=prompt, **fields))
        for last in engine.generate(GenerationRequest(**{**request.__dict__, "max_tokens": tokens,
                                                         "ignore_eos": not chat, "cache_prompt": False})):
            pass
        s = last.stats
        generated += s.generated_tokens
        seconds += s.decode_seconds - (s.time_to_first_token - s.prefill_seconds)
        drafted += s.drafted
        accepted += s.accepted
        generated -= 1  # the first token came with the prefill
    return generated / seconds, (accepted / drafted if drafted else float("nan"))


def as_mlx_lm_runs_it(engine: Engine) -> tuple:
    """(target, draft): the engine's checkpoints in its dtype, without runner.row_padding (mlx-lm's layers
    as they ship)."""
    return tuple(load_model(loaded.path, loaded.dtype, row_padding=False).model if loaded else None
                 for loaded in (engine.target, engine.draft))


def reference(engine: Engine, models: tuple, prompts, tokens: int, chat: bool, k: int) -> float:
    """mlx-lm's generators on ``models`` (``as_mlx_lm_runs_it``); prompts tokenized by ``engine``; timed
    from the first token."""
    target, draft = models
    ends = frozenset(engine.tokenizer.eos_token_ids) | end_of_turn_ids(engine.tokenizer) if chat else frozenset()
    generated, seconds = 0, 0.0
    for prompt in prompts:
        ids = (engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
               if chat else engine.tokenizer.encode(prompt))
        if k == 0:
            steps = generate_step(mx.array(ids), target, max_tokens=tokens)
        else:
            steps = speculative_generate_step(mx.array(ids), target, draft,
                                              num_draft_tokens=k, max_tokens=tokens)
        start = None
        for out in steps:  # (token, logprobs[, from_draft])
            start = start or time.perf_counter()
            generated += 1
            if int(out[0]) in ends:
                break
        seconds += time.perf_counter() - start
        generated -= 1
    return generated / seconds


def table(title: str, engine: Engine, tokens: int, chat: bool, rows: list) -> dict:
    kinds = {"prose": PROSE, "input-grounded": GROUNDED_CHAT if chat else GROUNDED_TEXT}
    length = f"greedy answers of up to {tokens} tokens" if chat else f"{tokens} greedy tokens per prompt"
    print(f"## speculation: {title}, {length} "
          f"({len(PROSE)} prose prompts, {len(GROUNDED_TEXT)} input-grounded)\n")
    print("| decoder | " + " | ".join(f"{kind} tok/s | vs our plain | acceptance" for kind in kinds) + " |")
    print("| --- | " + " | ".join("--- | --- | ---" for _ in kinds) + " |")
    ours(engine, PROSE[:1], 16, chat, drafter="none")  # warm-up
    results = {}
    for label, run in rows:
        results[label] = {kind: run(prompts) for kind, prompts in kinds.items()}
    base = results["ours, plain"]
    for label, by_kind in results.items():
        cells = []
        for kind, (rate, acceptance) in by_kind.items():
            shown = "-" if acceptance != acceptance else f"{acceptance:.2f}"
            cells.append(f"{rate:.1f} | {rate / base[kind][0]:.2f}x | {shown}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print()
    return results


def run() -> None:
    pair = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, EngineSettings(prompt_cache_bytes=0))
    pair_as_mlx_lm = as_mlx_lm_runs_it(pair)
    n = 256
    rows = [("ours, plain", lambda p: ours(pair, p, n, False, drafter="none")),
            ("mlx-lm generate_step", lambda p: (reference(pair, pair_as_mlx_lm, p, n, False, 0), float("nan")))]
    rows += [(f"ours, draft model, k = {k}", lambda p, k=k: ours(pair, p, n, False, drafter="model", num_draft_tokens=k))
             for k in range(1, 7)]
    rows += [(f"mlx-lm speculative_generate_step, k = {k}", lambda p, k=k: (reference(pair, pair_as_mlx_lm, p, n, False, k), float("nan")))
             for k in range(1, 7)]
    rows += [("ours, n-gram, adaptive", lambda p: ours(pair, p, n, False, drafter="ngram")),
             ("ours, draft model, adaptive (default)", lambda p: ours(pair, p, n, False))]
    table("default pair (draft model)", pair, n, False, rows)

    smol = Engine.load(SMOLLM2_DIR, None, EngineSettings(prompt_cache_bytes=0))
    smol_as_mlx_lm = as_mlx_lm_runs_it(smol)
    n = 160
    rows = [("ours, plain", lambda p: ours(smol, p, n, True, drafter="none")),
            ("mlx-lm generate_step", lambda p: (reference(smol, smol_as_mlx_lm, p, n, True, 0), float("nan")))]
    rows += [(f"ours, n-gram, k = {k}", lambda p, k=k: ours(smol, p, n, True, drafter="ngram", num_draft_tokens=k))
             for k in (1, 2, 4, 6)]
    rows += [("ours, n-gram, adaptive (default)", lambda p: ours(smol, p, n, True))]
    table("SmolLM2-135M-Instruct in float32 (no draft model: n-gram lookup)", smol, n, True, rows)
