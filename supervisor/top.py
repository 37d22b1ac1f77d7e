"""``python -m supervisor top``: a live view of every model, like ``ollama ps`` and ``htop`` together.

Each frame is one GetStatus call: per model its state, pid, memory (RSS against
its soft and hard limits, MLX's active memory and pool), requests decoding and
waiting in its runner, generated tokens per second (the supervisor's count of
generated tokens, differenced between two frames), for an embedding or reranking
model its inputs and Embed/Rerank requests per second and their mean time over the
same interval, the last request's draft acceptance, the prompt cache's use and the
restarts. On a terminal the frame is
redrawn in place every ``--interval`` seconds until Ctrl-C; ``--once`` prints a
single frame (two GetStatus calls a second apart, for the rate) and exits, for
scripts and for output that is not a terminal.
"""

from __future__ import annotations

import sys
import time

from .client import STATE_NAMES

CLEAR = "\x1b[H\x1b[2J"
COLUMNS = (
    ("MODEL", 16),
    ("STATE", 9),
    ("PID", 7),
    ("RSS", 9),
    ("SOFT", 8),
    ("HARD", 8),
    ("MLX", 15),
    ("RUN", 4),
    ("WAIT", 5),
    ("TOK/S", 7),
    ("IN/S", 6),
    ("REQ/S", 6),
    ("LAT", 7),
    ("ACCEPT", 7),
    ("PROMPT CACHE", 22),
    ("RESTARTS", 8),
)


def size(value: int) -> str:
    """Bytes as MiB or GiB, in at most 7 characters; "-" for none."""
    if not value:
        return "-"
    if value >= 10 * 2**30:
        return f"{value / 2**30:.0f}G"
    if value >= 2**30:
        return f"{value / 2**30:.1f}G"
    return f"{value / 2**20:.0f}M"


def embedding_rates(model, before, elapsed: float) -> list[str]:
    """IN/S, REQ/S and LAT of a model: its Embed and Rerank inputs and requests a second and their mean time
    since ``before`` (the same model's earlier ModelStatus); "-" for a model never asked any, or with no earlier
    reading (LAT: with no request in between)."""
    if before is None or elapsed <= 0 or not model.embed_requests:
        return ["-", "-", "-"]
    requests = max(0, model.embed_requests - before.embed_requests)
    inputs = max(0, model.embedded_inputs - before.embedded_inputs)
    latency = f"{1e3 * (model.embed_seconds - before.embed_seconds) / requests:.0f}ms" if requests else "-"
    return [f"{inputs / elapsed:.0f}", f"{requests / elapsed:.1f}", latency]


def row(model, rate: float | None, embedding: list[str] = ("-", "-", "-")) -> list[str]:
    memory = model.memory
    cache = memory.prompt_cache
    serving = model.pid != 0
    return [
        model.name,
        STATE_NAMES[model.state],
        str(model.pid or "-"),
        size(memory.rss) if serving else "-",
        size(memory.soft_limit),
        size(memory.hard_limit),
        f"{size(memory.mlx_active)}+{size(memory.mlx_cache)}" if serving else "-",
        str(memory.active_requests) if serving else "-",
        str(memory.queued) if serving else "-",
        "-" if rate is None or not serving else f"{rate:.0f}",
        *embedding,
        f"{model.acceptance_rate:.2f}" if model.acceptance_rate else "-",
        f"{size(cache.bytes)}/{size(cache.budget)} {cache.entries}e {cache.hits}h" if cache.budget else "off",
        str(model.restarts),
    ]


def frame(status, previous=None, elapsed: float = 0.0) -> str:
    """One screen: a header line and a row per model; ``previous`` (an earlier GetStatus) gives the rates."""
    before = {m.name: m for m in previous.models} if previous is not None else {}
    lines = [
        f"mlxserve {status.version}, supervisor pid {status.pid}, up {status.uptime_s:.0f} s, "
        f"{'ready' if status.ready else 'not ready'}, at most {status.max_loaded} models loaded"
        f"  (RUN: requests decoding; WAIT: queued; MLX: active+pool; IN/S, REQ/S, LAT: embedding or rerank inputs"
        " and requests a second, their mean time)",
        "",
        " ".join(name.ljust(width) for name, width in COLUMNS).rstrip(),
    ]
    for model in status.models:
        rate = None
        if model.name in before and elapsed > 0:
            rate = max(0, model.generated_tokens - before[model.name].generated_tokens) / elapsed
        cells = row(model, rate, embedding_rates(model, before.get(model.name), elapsed))
        lines.append(" ".join(cell.ljust(width) for cell, (_, width) in zip(cells, COLUMNS)).rstrip())
    for model in status.models:  # max_loaded: a model waits for this one's place
        if model.making_room_for:
            lines.append(
                f"{model.name} makes room for {model.making_room_for}: new requests wait, evicted once its"
                f" {model.in_flight} in flight end"
            )
    for pull in status.pulls:  # hub repositories being fetched
        share = f"{100 * pull.completed / pull.total:.0f}%" if pull.total else "starting"
        mib = f"{pull.completed / 2**20:.0f} of {pull.total / 2**20:.0f} MiB"
        lines.append(f"pulling {pull.model}: {share}, {mib} ({pull.status})")
    return "\n".join(lines)


def run(client, once: bool, interval: float, out=sys.stdout) -> int:
    previous, taken = client.get_status(), time.monotonic()
    if once:
        time.sleep(1.0)
        now = client.get_status()
        out.write(frame(now, previous, time.monotonic() - taken) + "\n")
        return 0
    live = out.isatty()
    try:
        while True:
            time.sleep(interval)
            now, at = client.get_status(), time.monotonic()
            out.write((CLEAR if live else "\n") + frame(now, previous, at - taken) + "\n")
            out.flush()
            previous, taken = now, at
    except KeyboardInterrupt:
        return 0
