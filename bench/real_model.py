"""The real models (SmolLM2-135M-Instruct, Gemma 3 270M): prompt processing, generation and RSS, through the
runner vs mlx-lm in-process.

Both sides get the same chat prompt (~270 tokens) and generate the same number
of greedy tokens, once with the weights as stored (4-bit, dtype "checkpoint")
and once dequantized to float32 (dtype "float32", what "auto" picks on the
CPU). mlx-lm's ``generate_step`` runs in a fresh process of its own, so its RSS
is its own; the runner's figures come from its Memory RPC.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common.defaults import GEMMA3_DIR, SMOLLM2_DIR

GENERATED = 128
SYSTEM = (
    "You are a careful assistant. Answer in plain English, in short paragraphs, and say so when you are not "
    "sure of a fact. "
) * 6
QUESTION = (
    "Explain how a speculative decoding server for language models works: what the draft model does, "
    "what the target model checks, why the key-value cache has to be rewound, and what happens to memory."
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]

MLX_LM_SIDE = r"""
import json, sys, time
from common.cpu_blas import reexec_with_fast_blas
reexec_with_fast_blas()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model
folder, dtype, generated = sys.argv[1], sys.argv[2], int(sys.argv[3])
model, tokenizer = load(folder)
if dtype == "float32":
    dequantize_model(model)
    model.set_dtype(mx.float32)
mx.eval(model.parameters())
prompt = tokenizer.apply_chat_template(json.loads(sys.argv[4]), add_generation_prompt=True)
start = time.perf_counter()
first = None
for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=generated)):
    if first is None:
        first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({"prompt_tokens": len(prompt), "prefill_s": first - start, "decode_s": end - first,
                  "generated": generated - 1,
                  # VmHWM, as the runner reports: ru_maxrss would start at the forking parent's RSS
                  "peak_rss": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024}))
"""


MODELS = (
    ("SmolLM2-135M-Instruct (Q4_1 GGUF, imported)", SMOLLM2_DIR),
    ("Gemma 3 270M (Q4_K_M GGUF, imported; 15 of 18 layers slide over 512 tokens)", GEMMA3_DIR),
)


def mlx_lm_side(folder: Path, dtype: str) -> dict:
    from tests.processes import child_environment

    done = subprocess.run(
        [sys.executable, "-c", MLX_LM_SIDE, str(folder), dtype, str(GENERATED), json.dumps(MESSAGES)],
        capture_output=True,
        text=True,
        env=child_environment(),
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def runner_side(folder: Path, dtype: str) -> dict:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from common.protocol import runner_pb2
    from tests.processes import RunnerProcess

    prompt = load_tokenizer(folder).apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    with tempfile.TemporaryDirectory() as sockets:
        runner = RunnerProcess(
            Path(sockets) / "sockets", "--dtype", dtype, target=folder, draft=None, name=folder.name
        ).wait_serving(300)
        try:
            last = None
            for last in runner.client.generate(timeout=900, prompt=prompt, max_tokens=GENERATED, ignore_eos=True):
                pass
            memory = runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5)
        finally:
            runner.stop()
    s = last.stats
    # Same measure as the mlx-lm side: prefill until the first token, then the rest.
    return {
        "prompt_tokens": s.prompt_tokens,
        "prefill_s": s.time_to_first_token_s,
        "decode_s": s.decode_s - (s.time_to_first_token_s - s.prefill_s),
        "generated": s.generated_tokens - 1,
        "peak_rss": memory.peak_rss,
    }


def run() -> None:
    for label, folder in MODELS:
        table(label, folder)


def table(model: str, folder: Path) -> None:
    print(f"## real model: {model}, chat prompt, {GENERATED} greedy tokens\n")
    print(
        "| weights | path | prompt tokens | prompt tok/s | generation tok/s | peak RSS | vs mlx-lm (prompt / generation) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, label in (("checkpoint", "4-bit as stored"), ("float32", "dequantized to float32 (auto)")):
        ours, theirs = runner_side(folder, dtype), mlx_lm_side(folder, dtype)
        rates = {}
        for name, r in (("runner over gRPC", ours), ("mlx-lm generate_step, in-process", theirs)):
            rates[name] = (r["prompt_tokens"] / r["prefill_s"], r["generated"] / r["decode_s"])
        base = rates["mlx-lm generate_step, in-process"]
        for name, r in (("runner over gRPC", ours), ("mlx-lm generate_step, in-process", theirs)):
            pp, tg = rates[name]
            print(
                f"| {label} | {name} | {r['prompt_tokens']} | {pp:.0f} | {tg:.1f} | {r['peak_rss'] / 2**20:.0f} MiB "
                f"| {pp / base[0]:.2f}x / {tg / base[1]:.2f}x |"
            )
    print()
