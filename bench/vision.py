"""A model that sees (issue #39): image requests against mlx-vlm, a second turn's prefill, and batching.

On ``models/vision/smolvlm``, ``qwen2_vl``, ``qwen3_vl`` and ``qwen3_5`` (``make vision-model``: the real architectures with
random weights; their text models are tiny, so per-token overheads weigh more than in a real one):

- decode speed of image requests, the runner in-process (``Engine.generate``) against mlx-vlm's ``generate`` on
  the same image and prompt (its ``generation_tps``), greedy, alternated. Goal: >= 0.95x.
- time to first token of a second turn about the same image (the prompt cache holds its prefill) against the
  first (the image encoded and prefilled), as the caller of ``Engine.generate`` waits: the request prepared
  (template, image decoded and processed, keyed), then prefilled. Goal: <= 10%.
- 8 concurrent image requests through the supervisor's gRPC API, batched (max_batch 8) against one at a time
  (max_batch 1): aggregate tok/s.
"""

from __future__ import annotations

import io
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.speculation import after_first_token
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest

MODEL = Path(__file__).resolve().parents[1] / "models" / "vision" / "smolvlm"
ASK = "Describe the image."
TOKENS = 128
REPEATS = 3
CLIENTS = 8


def png(seed: int, size: tuple[int, int] = (128, 96)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def request(image: bytes, **fields) -> GenerationRequest:
    return GenerationRequest(messages=(("user", ASK, "", "", (), "", (image,)),), temperature=0.0, **fields)


def ours(engine: Engine, image: bytes) -> float:
    for last in engine.generate(request(image, max_tokens=TOKENS, ignore_eos=True, cache_prompt=False)):
        pass
    tokens, seconds = after_first_token(last.stats)
    return tokens / seconds


def theirs(model, processor, prompt: str, image: bytes) -> float:
    from mlx_vlm import generate
    from PIL import Image

    picture = Image.open(io.BytesIO(image)).convert("RGB")
    # mlx-vlm's generate has no ignore_eos: a random model rarely writes its end, and its rate is per token anyway.
    return generate(model, processor, prompt, image=[picture], max_tokens=TOKENS, temperature=0.0).generation_tps


def batching(max_batch: int) -> float:
    from tests.processes import SupervisorProcess, model_toml

    with tempfile.TemporaryDirectory() as folder:
        toml = model_toml("seer", target=MODEL, draft=None) + f"max_batch = {max_batch}\n"
        sup = SupervisorProcess(Path(folder), toml).wait_ready(300)
        try:
            counts = [0] * CLIENTS

            def client(c: int, seed: int) -> None:
                messages = [{"role": "user", "content": ASK, "images": [png(seed)]}]
                for chunk in sup.client.generate(
                    timeout=300, model="seer", messages=messages, max_tokens=TOKENS, ignore_eos=True
                ):
                    counts[c] += len(chunk.token_ids)

            for seed_base, timed in ((1000, False), (2000, True)):  # a warm-up load, then the timed one
                threads = [threading.Thread(target=client, args=(c, seed_base + c)) for c in range(CLIENTS)]
                counts[:] = [0] * CLIENTS
                started = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.perf_counter() - started
            return sum(counts) / wall
        finally:
            sup.stop()


FAMILIES = {  # folder name under models/vision -> what it is (each with random weights)
    "smolvlm": "SmolVLM: plain positions",
    "qwen2_vl": "Qwen2-VL: M-RoPE",
    "qwen3_vl": "Qwen3-VL: M-RoPE, deepstack",
    "qwen3_5": "Qwen3.5: M-RoPE, hybrid, thinks",
}


def compare(folder: Path) -> dict:
    """Decode tok/s of the runner in-process and of mlx-vlm's generate (alternated), and the time to first token
    of a first and a second turn about one image, on the model in ``folder``."""
    from mlx_vlm import load

    engine = Engine.load(folder, None, RunnerSettings(dtype="checkpoint"))
    model, processor = load(str(folder))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ASK}]}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ours(engine, png(0)), theirs(model, processor, prompt, png(0))  # warm-up
    rates = {"runner": [], "mlx-vlm": []}
    for repeat in range(REPEATS):
        image = png(1 + repeat)
        order = [("runner", True), ("mlx-vlm", False)] if repeat % 2 == 0 else [("mlx-vlm", False), ("runner", True)]
        for label, runner in order:
            rates[label].append(ours(engine, image) if runner else theirs(model, processor, prompt, image))
    first, second = first_tokens(engine, 100, (128, 96))
    return {
        "mine": float(np.median(rates["runner"])),
        "reference": float(np.median(rates["mlx-vlm"])),
        "first": first,
        "second": second,
    }


def mid_size(folder: Path) -> Path:
    """A Qwen2-VL whose vision tower costs what a real one's does next to its prefill: width 256, 4 heads, 4 blocks
    (Qwen2-VL-2B's: 1280, 16, 32), at 448x448 (1024 patches, 256 image tokens), over the tiny one's tokenizer,
    template and text model; random weights, built in ``folder``."""
    import json
    import shutil
    import sys

    import mlx.core as mx
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(MODEL.parents[1]))
    from train_vision_qwen2vl import FAMILIES as QWEN
    from train_vision_qwen2vl import make_model

    source = MODEL.parent / "qwen2_vl"
    for path in source.iterdir():
        if path.name != "model.safetensors":
            shutil.copy(path, folder / path.name)
    config = json.loads(json.dumps(QWEN["qwen2_vl"]))
    config["vision_config"].update(depth=4, embed_dim=256, num_heads=4)
    pre = json.loads((source / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**pre, "max_pixels": 448 * 448}))
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(make_model(config).parameters())))
    return folder


def first_tokens(engine: Engine, seed: int, size: tuple[int, int]) -> tuple[float, float]:
    """Median time to first token of a first and a second turn about one image (the prompt cache holds its
    prefill), as the caller of ``Engine.generate`` waits: the request prepared (template, image decoded and
    processed, keyed), then prefilled."""
    first, second = [], []
    for repeat in range(REPEATS):
        image = png(seed + repeat, size)
        for target in (first, second):
            started = time.perf_counter()
            rounds = engine.generate(request(image, max_tokens=8))
            next(rounds)
            target.append(time.perf_counter() - started)
            for _ in rounds:
                pass
    return float(np.median(first)), float(np.median(second))


def run() -> None:
    figures = {name: compare(MODEL.parent / name) for name in FAMILIES}
    with tempfile.TemporaryDirectory() as folder:
        mid = Engine.load(mid_size(Path(folder)), None, RunnerSettings(dtype="checkpoint"))
        mid_first, mid_second = first_tokens(mid, 200, (448, 448))
    on, off = batching(CLIENTS), batching(1)
    print(f"## vision: tiny models with random weights (models/vision), one image, {TOKENS} greedy tokens\n")
    print(
        "| model | runner in-process | mlx-vlm generate | runner vs mlx-vlm (goal >= 0.95x) | TTFT first / second turn (goal <= 10%) |"
    )
    print("| --- | --- | --- | --- | --- |")
    for name, f in figures.items():
        print(
            f"| {name} ({FAMILIES[name]}) | {f['mine']:.0f} tok/s | {f['reference']:.0f} tok/s | "
            f"{f['mine'] / f['reference']:.2f}x | {f['first'] * 1e3:.1f} ms / {f['second'] * 1e3:.1f} ms "
            f"({f['second'] / f['first']:.0%}) |"
        )
    print(
        f"| qwen2_vl with a mid-size tower (width 256, 4 blocks; 448x448, 256 image tokens) | | | | "
        f"{mid_first * 1e3:.1f} ms / {mid_second * 1e3:.1f} ms ({mid_second / mid_first:.1%}) |"
    )
    print(
        f"\n{CLIENTS} concurrent image requests to smolvlm through the supervisor, batched / one at a time: "
        f"{on:.0f} / {off:.0f} tok/s ({on / off:.2f}x)\n"
    )


if __name__ == "__main__":
    run()
