"""Claude Code against the server (docs/clients.md): its turn with the smallest flags that fit SmolLM2's 8,192
tokens, its default flags refused at once there, and its default flags served by a model with the room (Gemma 3
270M, 32,768 tokens), two turns, with each request's prompt, what the prompt cache gave and the prefill time.

Claude Code 2.1.197 from npm (`make clients`), `claude -p` with telemetry off; models greedy by their
`sampling` default (Claude Code sends no temperature). Gemma 3 270M is the base model: its calls are not
useful ones, and the point is the size of the prompt and how fast it is served again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

from common.defaults import GEMMA3_DIR, SMOLLM2_DIR
from tests.helpers import CHAT_TOKEN
from tests.processes import SupervisorProcess, model_toml

CLAUDE = Path(__file__).resolve().parents[1] / ".clients" / "node_modules" / ".bin" / "claude"
ASK = "What is the capital of France?"
SMALL = ("--tools", "", "--system-prompt", "You are a helpful assistant. Be brief.")
ENDED = re.compile(r"prompt (\d+) tokens \((\d+) from the prompt cache\), prefilled in ([\d.]+) s")


def claude(sup: SupervisorProcess, model: str, home: Path, *flags: str) -> tuple[float, str]:
    env = {
        **os.environ,
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": sup.base_url.removesuffix("/v1"),
        "ANTHROPIC_API_KEY": CHAT_TOKEN,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512",
    }
    started = time.perf_counter()
    done = subprocess.run(
        [str(CLAUDE), "-p", ASK, "--model", model, *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=home,
    )
    said = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return time.perf_counter() - started, (said[0] if said else "")[:90]


def requests_of(sup: SupervisorProcess, model: str, since: int) -> list[tuple[int, int, float]]:
    """(prompt tokens, of them from the prompt cache, prefill seconds) of each request the model's runner ended
    after the log's line ``since``."""
    out = []
    for line in sup.stderr.splitlines()[since:]:
        record = json.loads(line)
        match = ENDED.search(record["message"]) if record.get("model") == model else None
        if match:
            out.append((int(match.group(1)), int(match.group(2)), float(match.group(3))))
    return out


def run() -> None:
    assert CLAUDE.exists(), f"{CLAUDE} is missing: run `make clients`"
    models = (
        model_toml("smol", target=SMOLLM2_DIR, draft=None)
        + "sampling = {temperature = 0}\n"
        + model_toml("gemma", target=GEMMA3_DIR, draft=None, load_at_start=False)
        + "sampling = {temperature = 0}\n"
    )
    with tempfile.TemporaryDirectory() as folder:
        home = Path(folder) / "home"
        home.mkdir()
        sup = SupervisorProcess(Path(folder), models, auth_token=CHAT_TOKEN, log_format="json").wait_ready(300)
        try:
            print("### Claude Code 2.1.197, `claude -p`, greedy models\n")
            print("| model (context) | flags | wall s | requests: prompt tokens / from the cache / prefill s | said |")
            print("| --- | --- | ---: | --- | --- |")
            for model, context, flags, label in (
                ("smol", "SmolLM2, 8,192", (), "default"),
                ("smol", "SmolLM2, 8,192", SMALL, '`--tools "" --system-prompt ...`'),
                ("gemma", "Gemma 3 270M, 32,768", ("--max-turns", "2"), "default, `--max-turns 2`"),
            ):
                since = len(sup.stderr.splitlines())
                seconds, said = claude(sup, model, home, *flags)
                served = "; ".join(f"{p} / {c} / {s:.1f}" for p, c, s in requests_of(sup, model, since)) or "refused"
                print(f"| {context} | {label} | {seconds:.1f} | {served} | {said} |")
        finally:
            sup.stop()
    print(
        "\nThe default flags send ~21k tokens (system prompt, a mid-conversation system message, 24 tools): "
        "SmolLM2 refuses them with Anthropic's `prompt is too long`, which Claude Code shows at once; Gemma 3 "
        "serves them, the first request prefilling the whole prompt and the next ones taking it from the "
        "prompt cache."
    )
