"""Importing GGUF files: the exact mx.load path against the gguf-reader path, on SmolLM2.

Three files of the same model: the shipped Q4_1 file (every tensor a type
``mx.load`` reads exactly), and the same weights rewritten by llama.cpp's
Python quantizers (``gguf.quants``) as Q5_0/Q5_1 and as Q8_0, the types
llama.cpp falls back to in a K-quant file when rows are not a multiple of 256
(SmolLM2's 576). ``mx.load`` cannot read the Q5 file; the importer reads it
with ``gguf``. For each: import seconds, the folder's size, how far the
imported weights are from llama.cpp's own dequantization of the file, and the
answer to the capital question (float32 on the CPU, as served).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from runner.defaults import SMOLLM2_DIR

QUESTION = "What is the capital of France?"


def largest_difference(source: Path, folder: Path) -> float:
    """Over every quantized tensor: the largest |imported - llama.cpp's dequantization|, Q/K rows compared in
    the importer's order."""
    import gguf
    import mlx.core as mx
    import numpy as np
    from gguf.quants import dequantize

    from runner.gguf import mlx_name, unpermute_rows

    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    quantization = config["quantization"]
    worst = 0.0
    for tensor in gguf.GGUFReader(str(source)).tensors:
        if tensor.tensor_type.name in ("F32", "F16", "BF16"):
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            expected = unpermute_rows(expected, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            expected = unpermute_rows(expected, config["num_key_value_heads"])
        base = mlx_name(tensor.name).removesuffix(".weight")
        bits = quantization.get(base, quantization)["bits"]
        got = mx.dequantize(weights[f"{base}.weight"], weights[f"{base}.scales"], weights[f"{base}.biases"],
                            group_size=32, bits=bits)
        worst = max(worst, float(np.max(np.abs(np.array(got.astype(mx.float32)) - expected))))
    return worst


def answer(folder: Path) -> str:
    from runner.engine import Engine, EngineSettings
    from runner.request import GenerationRequest

    engine = Engine.load(folder, None, EngineSettings(prompt_cache_bytes=0))
    return "".join(r.text for r in engine.generate(GenerationRequest(messages=(("user", QUESTION),), max_tokens=30)))


def run() -> None:
    import gguf

    from runner.gguf import import_gguf
    from tests.helpers import rewrite_gguf

    Q = gguf.GGMLQuantizationType
    source = SMOLLM2_DIR.parent.parent / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    print("## GGUF import: SmolLM2-135M-Instruct\n")
    print("| file | read by | import | folder | largest difference from llama.cpp's dequantization | answer |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        def q5(name, kind):
            return None if kind != Q.Q4_1 else (Q.Q5_0 if ".attn_" in name else Q.Q5_1)

        def q8(name, kind):
            return None if kind != Q.Q4_1 else Q.Q8_0

        files = [("Q4_1 (as shipped), Q8_0 embedding", source, "mx.load"),
                 ("Q5_0 attention, Q5_1 MLP, Q8_0 embedding", rewrite_gguf(source, tmp / "q5.gguf", q5), "gguf"),
                 ("Q8_0 everywhere", rewrite_gguf(source, tmp / "q8.gguf", q8), "mx.load")]
        for label, path, reader in files:
            out = tmp / f"out-{path.stem}"
            started = time.perf_counter()
            import_gguf(path, out)
            seconds = time.perf_counter() - started
            size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
            text = answer(out).strip().replace("\n", " ")
            print(f"| {label} | {reader} | {seconds:.1f} s | {size:.0f} MiB | {largest_difference(path, out):.2g} "
                  f"| {text[:60]} |")
    print()
