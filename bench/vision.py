"""A model that sees (issue #39): image requests against mlx-vlm, a second turn's prefill, and batching.

On ``models/vision/smolvlm`` (``make vision-model``: SmolVLM's architecture with random weights; its text model is
tiny, so per-token overheads weigh more than in a real one):

- decode speed of image requests, the runner in-process (``Engine.generate``) against mlx-vlm's ``generate`` on
  the same image and prompt (its ``generation_tps``), greedy, alternated. Goal: >= 0.95x.
- time to first token of a second turn about the same image (the prompt cache holds its prefill) against the
  first (the image encoded and prefilled). Goal: <= 10%.
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


def png(seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)
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


def run() -> None:
    from mlx_vlm import load

    engine = Engine.load(MODEL, None, RunnerSettings(dtype="checkpoint"))
    model, processor = load(str(MODEL))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ASK}]}]
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ours(engine, png(0)), theirs(model, processor, prompt, png(0))  # warm-up
    rates = {"runner": [], "mlx-vlm": []}
    for repeat in range(REPEATS):
        image = png(1 + repeat)
        order = [("runner", True), ("mlx-vlm", False)] if repeat % 2 == 0 else [("mlx-vlm", False), ("runner", True)]
        for label, runner in order:
            rates[label].append(ours(engine, image) if runner else theirs(model, processor, prompt, image))
    first, second = [], []
    for repeat in range(REPEATS):
        image = png(100 + repeat)
        for target in (first, second):
            for last in engine.generate(request(image, max_tokens=8)):
                pass
            target.append(last.stats.time_to_first_token)
    on, off = batching(CLIENTS), batching(1)
    mine, reference = np.median(rates["runner"]), np.median(rates["mlx-vlm"])
    print(f"## vision: models/vision/smolvlm (SmolVLM, random weights), one image, {TOKENS} greedy tokens\n")
    print("| what | figure | goal |")
    print("| --- | --- | --- |")
    print(f"| decode, runner in-process | {mine:.0f} tok/s | |")
    print(f"| decode, mlx-vlm generate | {reference:.0f} tok/s | |")
    print(f"| runner vs mlx-vlm | {mine / reference:.2f}x | >= 0.95x |")
    print(
        f"| time to first token, first turn / second turn (same image) | {np.median(first) * 1e3:.1f} ms / "
        f"{np.median(second) * 1e3:.1f} ms ({np.median(second) / np.median(first):.0%}) | <= 10% |"
    )
    print(
        f"| {CLIENTS} concurrent image requests, batched / one at a time | {on:.0f} / {off:.0f} tok/s ({on / off:.2f}x) | |"
    )
    print()


if __name__ == "__main__":
    run()
