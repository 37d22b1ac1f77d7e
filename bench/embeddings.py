"""Embeddings (issue #42): all-MiniLM-L6-v2 (``make embedding-model``) through a real supervisor over HTTP.

- texts/s at batch 1 (one sentence a request, one client) and at batch 64 (64 sentences a request);
- p50 / p95 latency and texts/s under 16 concurrent clients sending one sentence each (the runner packs their
  inputs into shared batches);
- the same model in-process (``EmbeddingEngine.run``, no server) at batch 1 and 64, for the serving overhead;
- fastembed (ONNX Runtime) and sentence-transformers on the same CPU, where they are installed: a row says so
  where they are not (sentence-transformers needs PyTorch; fastembed needs the model's ONNX export, which the
  PyPI package does not ship and whose export needs PyTorch too).

The server's figures and the in-process ones are alternated in one run.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import util
from pathlib import Path

import httpx

from common.defaults import MINILM_DIR

SENTENCES = [
    "The cat sits on the mat.",
    "A man is playing a guitar on the stage tonight, and the crowd sings along.",
    "Stock markets fell sharply on Monday after the central bank raised interest rates again.",
    "How do I bake sourdough bread at home?",
    "Photosynthesis converts light energy into chemical energy in plants.",
    "The Great Wall of China is thousands of kilometres long.",
    "Python is a programming language that emphasises code readability.",
    "Bananas are rich in potassium.",
]
CLIENTS = 16
ROUNDS = 2


def texts(n: int, offset: int = 0) -> list[str]:
    return [f"{SENTENCES[(i + offset) % len(SENTENCES)]} ({i + offset})" for i in range(n)]


def server_figures(url: str) -> dict:
    with httpx.Client(timeout=120) as client:

        def post(inputs):
            started = time.perf_counter()
            response = client.post(url, json={"model": "minilm", "input": inputs})
            response.raise_for_status()
            return time.perf_counter() - started

        started = time.perf_counter()
        for i in range(64):
            post(texts(1, i))
        batch1 = 64 / (time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(8):
            post(texts(64, 64 * i))
        batch64 = 8 * 64 / (time.perf_counter() - started)

    def client_run(c: int) -> list[float]:
        with httpx.Client(timeout=120) as own:
            out = []
            for i in range(8):
                started = time.perf_counter()
                own.post(url, json={"model": "minilm", "input": texts(1, 100 * c + i)}).raise_for_status()
                out.append(time.perf_counter() - started)
            return out

    started = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        latencies = sorted(x for run in pool.map(client_run, range(CLIENTS)) for x in run)
    wall = time.perf_counter() - started
    return {
        "batch1": batch1,
        "batch64": batch64,
        "p50": statistics.median(latencies),
        "p95": latencies[int(0.95 * (len(latencies) - 1))],
        "concurrent": len(latencies) / wall,
    }


def in_process(engine) -> dict:
    started = time.perf_counter()
    for i in range(64):
        engine.run(engine.embed_rows(texts(1, i), [], True, 0, "")[0])
    batch1 = 64 / (time.perf_counter() - started)
    started = time.perf_counter()
    for i in range(8):
        engine.run(engine.embed_rows(texts(64, 64 * i), [], True, 0, "")[0])
    return {"batch1": batch1, "batch64": 8 * 64 / (time.perf_counter() - started)}


def run() -> None:
    from common.settings import RunnerSettings
    from runner.embedding.engine import EmbeddingEngine
    from tests.processes import SupervisorProcess, model_toml

    engine = EmbeddingEngine.load(MINILM_DIR, RunnerSettings(target=MINILM_DIR))
    with tempfile.TemporaryDirectory() as folder:
        sup = SupervisorProcess(Path(folder), model_toml("minilm", target=MINILM_DIR, draft=None)).wait_ready(120)
        url = sup.base_url + "/embeddings"
        try:
            server_figures(url)  # warm-up
            served, local = [], []
            for _ in range(ROUNDS):  # alternated
                served.append(server_figures(url))
                local.append(in_process(engine))
        finally:
            sup.stop()

    def best(runs, key):
        return max(r[key] for r in runs)

    print("## embeddings: all-MiniLM-L6-v2 (float32), short sentences (10-20 tokens)\n")
    print("| what | texts/s at batch 1 | texts/s at batch 64 | 16 concurrent clients: texts/s | p50 | p95 |")
    print("| --- | --- | --- | --- | --- | --- |")
    p50 = min(r["p50"] for r in served)
    p95 = min(r["p95"] for r in served)
    print(
        f"| mlxserve over HTTP (/v1/embeddings) | {best(served, 'batch1'):.0f} | {best(served, 'batch64'):.0f} | "
        f"{best(served, 'concurrent'):.0f} | {p50 * 1e3:.1f} ms | {p95 * 1e3:.1f} ms |"
    )
    print(
        f"| the same engine in-process (no server) | {best(local, 'batch1'):.0f} | {best(local, 'batch64'):.0f} "
        "| - | - | - |"
    )
    for name, module in (("fastembed (ONNX Runtime)", "fastembed"), ("sentence-transformers", "sentence_transformers")):
        if util.find_spec(module) is None:
            print(f"| {name} | not installed | | | | |")
    print(f"\nBest of {ROUNDS} alternated rounds; p50/p95 over {CLIENTS} clients x 8 requests, the lower round's.")
