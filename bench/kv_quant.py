"""Quantized KV caches (kv_bits): what they cost in quality and speed, and what they save.

For the default pair's target and for SmolLM2-135M-Instruct (both float32 on a
CPU), at kv_bits 0 (float), 8 and 4 with groups of 64:

- greedy agreement with the float cache: plain decoding (no drafter) of
  ``GENERATED`` tokens from three prompts; the first position where the tokens
  differ, and the share of positions that agree;
- perplexity of a fixed text (Python's own reference, pydoc topics) fed in
  ``CHUNK``-token pieces into one growing cache, quantized as the runner does
  (``KVQuantization.apply`` after each piece), each piece's next-token
  log-probabilities taken from the model's output;
- cache bytes per token (what the memory estimate and the prompt cache count)
  and plain decoding tok/s, runs alternated between the settings.

All through ``runner.engine.Engine`` in this process (the runner's own decode
path), so the numbers are the runner's, without gRPC.
"""

from __future__ import annotations

import statistics
import time
from pydoc_data.topics import topics

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR

BITS = (0, 8, 4)
GENERATED = 1000
PROMPTS = (
    "The for statement is used to iterate over",
    "def binary_search(items, target):\n",
    "Exceptions are raised when",
)
PPL_TOKENS = 2048
CHUNK = 128
SPEED_TOKENS = 300
SPEED_ROUNDS = 3


def tokens_of(engine, prompt: str, tokens: int) -> tuple[list[int], float]:
    from runner.request import GenerationRequest

    out, last = [], None
    request = GenerationRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True, drafter="none", cache_prompt=False)
    for last in engine.generate(request):
        out += last.token_ids
    return out, last.stats.tokens_per_second


def perplexity(engine, ids: list[int]) -> float:
    import math

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import make_prompt_cache

    model = engine.target.model
    cache = make_prompt_cache(model)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        piece = ids[start : start + CHUNK + 1]
        inputs, targets = mx.array(piece[:-1])[None], mx.array(piece[1:])[None]
        logits = model(inputs, cache=cache).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, targets, reduction="sum")
        total += losses.item()
        count += targets.size
        if engine.kv is not None:
            engine.kv.apply(cache)
        # the last token of this piece is the first input of the next: drop it from the cache's end
        for layer in cache:
            layer.trim(1)
    return math.exp(total / count)


def reference_text(tokenizer) -> list[int]:
    text = ""
    for name in ("for", "while", "try", "with", "assignment", "import", "function", "class", "if", "break"):
        text += topics[name] + "\n"
    return tokenizer.encode(text)[:PPL_TOKENS]


def model_rows(label: str, target, draft) -> list[str]:
    from common.settings import RunnerSettings
    from runner.engine import Engine

    engines = {bits: Engine.load(target, draft, RunnerSettings(prompt_cache=0, kv_bits=bits)) for bits in BITS}
    answers = {bits: [tokens_of(e, p, GENERATED)[0] for p in PROMPTS] for bits, e in engines.items()}
    ids = reference_text(engines[0].target.tokenizer)
    ppl = {bits: perplexity(e, ids) for bits, e in engines.items()}
    speeds = {bits: [] for bits in BITS}
    for _ in range(SPEED_ROUNDS):  # alternated, so drift in the machine's speed falls on every setting alike
        for bits, e in engines.items():
            speeds[bits].append(tokens_of(e, PROMPTS[0], SPEED_TOKENS)[1])
    rows = []
    for bits in BITS:
        firsts, agree, total = [], 0, 0
        for mine, reference in zip(answers[bits], answers[0]):
            first = next((i for i, (a, b) in enumerate(zip(mine, reference)) if a != b), len(reference))
            firsts.append(first)
            agree += sum(a == b for a, b in zip(mine, reference))
            total += len(reference)
        per_token = per_token_bytes(engines[bits])
        tok_s = statistics.median(speeds[bits])
        rows.append(
            f"| {label} | {'float' if not bits else f'{bits}-bit'} | "
            f"{' / '.join(str(f) if f < GENERATED else 'none' for f in firsts)} | {agree / total:.0%} | {ppl[bits]:.3f} "
            f"({ppl[bits] / ppl[0] - 1:+.2%}) | {per_token / 1024:.1f} KiB ({per_token / per_token_bytes(engines[0]):.2f}x) "
            f"| {tok_s:.1f} ({tok_s / statistics.median(speeds[0]):.2f}x) |"
        )
    return rows


def per_token_bytes(engine) -> float:
    """The target's cache bytes for one token, as the memory estimate counts them."""
    from common.footprint import ModelFootprint

    kv = engine.kv
    fp = ModelFootprint.of(engine.target.path)
    tokens = 4096
    return fp.kv_bytes(engine.target.compute_dtype, tokens, kv.bits if kv else 0, kv.group_size if kv else 64) / tokens


def run() -> None:
    print(
        f"## KV-cache quantization: greedy agreement over {GENERATED} tokens ({len(PROMPTS)} prompts), "
        f"perplexity of {PPL_TOKENS} tokens of Python's reference fed {CHUNK} at a time, groups of 64\n"
    )
    print(
        "| model | KV cache | first differing token (per prompt) | tokens agreeing with float | perplexity (vs float) "
        "| cache per token | plain decoding tok/s (vs float) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    started = time.perf_counter()
    for label, target, draft in (
        ("default pair target (float32)", DEFAULT_TARGET, DEFAULT_DRAFT),
        ("SmolLM2-135M-Instruct (float32)", SMOLLM2_DIR, None),
    ):
        for row in model_rows(label, target, draft):
            print(row, flush=True)
    print(
        f"\nBatching with kv_bits (rows at one `batch_memory`, batched tok/s, tokens alone) is measured by "
        f"`bench versus`. ({time.perf_counter() - started:.0f} s)\n"
    )
