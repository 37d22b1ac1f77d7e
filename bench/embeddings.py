"""Embeddings (issue #42): all-MiniLM-L6-v2 (``make embedding-model``) through a real supervisor over HTTP.

- texts/s at batch 1 (one sentence a request, one client) and at batch 64 (64 sentences a request);
- p50 / p95 latency and texts/s under 16 concurrent clients sending one sentence each (the runner packs their
  inputs into shared batches);
- the same model in-process (``EmbeddingEngine.run``, no server) at batch 1 and 64, for the serving overhead;
- one one-sentence request's time, one after the other on one connection: over HTTP and through the
  supervisor's gRPC Embed;
- sentence-transformers (PyTorch) on the same CPU and the same folder, at batch 1 and 64, where it is installed:
  in this interpreter, or in the one ``ST_PYTHON`` names (a throwaway venv with torch's CPU wheel and
  sentence-transformers: the project does not depend on PyTorch); a row says "not installed" otherwise, and the
  lowest cosine between its vectors and ours is printed beside it. fastembed is not run: it needs the model's
  ONNX export, which the PyPI package does not ship and whose export needs PyTorch too.

The server's figures, the in-process ones and sentence-transformers' are alternated in one run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
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


ST_SCRIPT = """
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from sentence_transformers import SentenceTransformer
if int(sys.argv[1]):
    torch.set_num_threads(int(sys.argv[1]))
folder, texts1, texts64 = json.loads(sys.stdin.read())
model = SentenceTransformer(folder, device="cpu")
model.encode(texts64[0])  # warm-up
started = time.perf_counter()
for t in texts1:
    model.encode(t, batch_size=1)
batch1 = len(texts1) / (time.perf_counter() - started)
started = time.perf_counter()
for t in texts64:
    model.encode(t, batch_size=64)
batch64 = sum(map(len, texts64)) / (time.perf_counter() - started)
vectors = model.encode(texts64[0][:8], normalize_embeddings=False).tolist()
print(json.dumps({"batch1": batch1, "batch64": batch64, "vectors": vectors}))
"""


def sentence_transformers_python() -> str | None:
    """An interpreter with sentence-transformers: this one, or ``ST_PYTHON``'s; None where neither has it."""
    if util.find_spec("sentence_transformers") is not None:
        return sys.executable
    given = os.environ.get("ST_PYTHON", "")
    if given and os.access(given, os.X_OK):
        found = subprocess.run([given, "-c", "import sentence_transformers"], capture_output=True)
        if found.returncode == 0:
            return given
    return None


def sentence_transformers_figures(python: str, threads: int) -> dict:
    """The same texts through sentence-transformers on the same folder, in its own process, on ``threads``
    threads (0: PyTorch's default, every core; our runner's MKL runs on one)."""
    work = json.dumps([str(MINILM_DIR), texts(64), [texts(64, 64 * i) for i in range(8)]])
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MKL_THREADING_LAYER")}  # torch: its own
    done = subprocess.run(
        [python, "-c", ST_SCRIPT, str(threads)], input=work, capture_output=True, text=True, env=env, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_request_times(sup, url: str, n: int = 30) -> dict:
    """The median time of one one-sentence request, one after the other (one connection): HTTP and gRPC."""
    from supervisor.protocol import supervisor_pb2

    with httpx.Client(timeout=120) as client:
        client.post(url, json={"model": "minilm", "input": "warm-up"}).raise_for_status()
        http = []
        for i in range(n):
            started = time.perf_counter()
            client.post(url, json={"model": "minilm", "input": texts(1, i)}).raise_for_status()
            http.append(time.perf_counter() - started)
    grpc = []
    for i in range(n):
        started = time.perf_counter()
        sup.client.stub.Embed(supervisor_pb2.EmbedRequest(model="minilm", texts=texts(1, i)), timeout=60)
        grpc.append(time.perf_counter() - started)
    return {"http": statistics.median(http), "grpc": statistics.median(grpc)}


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
            served, local, reference, one_thread, single = [], [], [], [], []
            st_python = sentence_transformers_python()
            for _ in range(ROUNDS):  # alternated
                served.append(server_figures(url))
                single.append(one_request_times(sup, url))
                local.append(in_process(engine))
                if st_python is not None:
                    reference.append(sentence_transformers_figures(st_python, 0))
                    one_thread.append(sentence_transformers_figures(st_python, 1))
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
    agreement = ""
    if reference:
        import numpy as np

        version = subprocess.run(
            [
                st_python,
                "-c",
                "import sentence_transformers, torch; print(sentence_transformers.__version__, torch.__version__)",
            ],
            capture_output=True,
            text=True,
        ).stdout.split()
        ours = np.array([engine.run(engine.embed_rows([t], [], True, 0, "")[0])[0] for t in texts(64)[:8]])
        theirs = np.array(reference[-1]["vectors"])
        theirs /= np.linalg.norm(theirs, axis=1, keepdims=True)
        ours = ours / np.linalg.norm(ours, axis=1, keepdims=True)
        agreement = f" Lowest cosine between its vectors and ours over 8 texts: {min((ours * theirs).sum(1)):.6f}."
        print(
            f"| sentence-transformers {version[0]} (PyTorch {version[1]}, CPU, every core) | "
            f"{best(reference, 'batch1'):.0f} | {best(reference, 'batch64'):.0f} | - | - | - |"
        )
        print(
            f"| sentence-transformers on one thread (torch.set_num_threads(1), as our runner's MKL) | "
            f"{best(one_thread, 'batch1'):.0f} | {best(one_thread, 'batch64'):.0f} | - | - | - |"
        )
    else:
        print("| sentence-transformers | skipped: not installed (set ST_PYTHON to a venv that has it) | | | | |")
    print("| fastembed (ONNX Runtime) | skipped: needs the model's ONNX export, not shipped | | | | |")
    print(
        f"\nBest of {ROUNDS} alternated rounds; p50/p95 over {CLIENTS} clients x 8 requests, the lower round's.{agreement}"
    )
    http = min(r["http"] for r in single)
    grpc = min(r["grpc"] for r in single)
    print(
        f"\nOne one-sentence request after another on one connection, median of 30 (the lower round's): "
        f"HTTP /v1/embeddings {http * 1e3:.1f} ms, the supervisor's gRPC Embed {grpc * 1e3:.1f} ms."
    )
