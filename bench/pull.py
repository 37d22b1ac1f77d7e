"""Pulling a model by name (supervisor/hub.py) over a stand-in hub on loopback (tests/hub_standin.py: no hub can
be reached from this machine): throughput against ``huggingface_hub.snapshot_download`` of the same files,
alternated three times each into fresh caches, each in a fresh process and timed from the call (not Python's
start). The pull also lists the repository, checks it before the weights (config, safetensors headers) and
checks each weight's sha256 after, which the client alone does not. Then the time from a request naming an
uncached repository (``pull = "any"``) to its first token: pull, load and prefill.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.defaults import DEFAULT_TARGET, GEMMA3_DIR, SMOLLM2_DIR

REPOS = {"SmolLM2-135M (safetensors)": SMOLLM2_DIR, "Gemma 3 270M (safetensors)": GEMMA3_DIR}
ROUNDS = 3


def timed_pull(endpoint: str, repo: str, how: str) -> float:
    """Seconds for one pull into a fresh cache, in a fresh process (the client reads its settings at import)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": cache, "HF_HUB_DISABLE_XET": "1"}
        env["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        if how == "ours":
            code = (  # the client imported before the clock starts, as it is for snapshot_download
                "from huggingface_hub import HfApi, hf_hub_download\nfrom supervisor import hub\n"
                "start = time.perf_counter()\n"
                f"hub.pull(hub.parse_ref({repo!r}))"
            )
        else:
            code = (
                "from huggingface_hub import snapshot_download\nstart = time.perf_counter()\n"
                f"snapshot_download({repo!r}, allow_patterns=['*.safetensors', '*.json'])"
            )
        code = f"import time\n{code}\nprint(time.perf_counter() - start)"  # the pull, not Python's start
        done = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
        return float(done.stdout.strip().splitlines()[-1])


def run() -> None:
    from tests.hub_standin import Repo, StandInHub
    from tests.processes import SupervisorProcess, model_toml

    repos = {
        f"org/{folder.name}": Repo({p.name: p for p in folder.iterdir() if not p.name.startswith(".")})
        for folder in REPOS.values()
    }
    with StandInHub(repos) as hub:
        print("### pull throughput, stand-in hub on loopback, 3 alternated rounds into fresh caches\n")
        print("| model | MiB | snapshot_download s | ours s | ours MiB/s | ratio (ours / snapshot_download) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for label, folder in REPOS.items():
            repo = f"org/{folder.name}"
            size = sum(p.stat().st_size for p in folder.iterdir() if not p.name.startswith("."))
            theirs, ours = [], []
            for _ in range(ROUNDS):
                theirs.append(timed_pull(hub.endpoint, repo, "snapshot_download"))
                ours.append(timed_pull(hub.endpoint, repo, "ours"))
            a, b = statistics.median(theirs), statistics.median(ours)
            print(f"| {label} | {size / 2**20:.0f} | {a:.2f} | {b:.2f} | {size / 2**20 / b:.0f} | {a / b:.2f}x |")

        print('\n### from a request naming an uncached repository to its first token (`pull = "any"`)\n')
        print("| model | first token s | of which the pull, s |")
        print("| --- | ---: | ---: |")
        with tempfile.TemporaryDirectory() as folder:
            cache = Path(folder) / "cache"
            env = {"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1"}
            models = model_toml("pair", target=DEFAULT_TARGET, draft=None, load_at_start=False)
            sup = SupervisorProcess(Path(folder) / "sup", models, env=env, pull="any").wait_ready(120)
            try:
                client = sup.openai()
                started = time.perf_counter()
                pulled = None
                stream = client.chat.completions.create(
                    model=f"org/{SMOLLM2_DIR.name}",
                    messages=[{"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=8,
                    temperature=0,
                    stream=True,
                )
                for event in stream:
                    if event.choices and event.choices[0].delta.content:
                        first = time.perf_counter() - started
                        break
                for event in stream:
                    pass
                pulled = pull_seconds(sup.stderr)
                print(f"| SmolLM2-135M | {first:.2f} | {pulled} |")
            finally:
                sup.stop()


def pull_seconds(log: str) -> str:
    """The pull's own time, from its log line ("pull REPO: done in N s")."""
    import re

    found = re.search(r"pull \S+: done in ([\d.]+) s", log)
    return found.group(1) if found else "-"
