"""The release rule, pictured: MLX's pool and the process RSS over one long speculative generation, with the
rule on and off.

Each mode runs in a fresh process: the default pair, k = 3, the prompt cache off and MLX's pool cap lifted
(``cache_limit = "unbounded"``, what Metal and CUDA default to, so the pool shows what the rule releases
rather than what the CPU's cap trims). After every round it records the generated count, MLX's active
memory, its pool and the process RSS. ``figure`` draws both runs with the 256-token boundaries marked;
``python -m bench release_rule`` writes docs/figures/release_rule.png and a table of the ends. The README
shows the figure where it explains why the project exists.
"""

from __future__ import annotations

from pathlib import Path

TOKENS = 4096
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "figures" / "release_rule.png"

ONE = r"""
import json, sys
import mlx.core as mx
import psutil
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import CACHE_LIMIT_UNBOUNDED, RunnerSettings
from runner.engine import Engine, GenerationRequest
release, tokens = sys.argv[1] == "on", int(sys.argv[2])
engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT,
                     RunnerSettings(cache_limit=CACHE_LIMIT_UNBOUNDED, release_enabled=release, prompt_cache=0))
process = psutil.Process()
mx.clear_cache()
generated, samples = 0, []
for round_ in engine.generate(GenerationRequest(prompt="Assignment statements are used to", max_tokens=tokens,
                                                num_draft_tokens=3, ignore_eos=True)):
    generated += len(round_.token_ids)
    samples.append((generated, mx.get_active_memory(), mx.get_cache_memory(), process.memory_info().rss))
print(json.dumps({"samples": samples, "releases": engine.total_releases}))
"""


def measure(release: bool, tokens: int) -> dict:
    """One generation in a fresh process: its per-round samples and its release count."""
    from .device import fresh_process

    result = fresh_process(ONE, "on" if release else "off", str(tokens))
    if isinstance(result, str):
        raise RuntimeError(f"release rule measurement failed: {result}")
    return result


def figure(runs: dict[bool, dict], path: Path, tokens: int) -> Path:
    """Two panels against generated tokens: MLX's pool (top) and the process RSS (bottom), rule on and off."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (pool_axis, rss_axis) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, constrained_layout=True)
    for release, style in ((False, {"color": "#c0392b", "label": "release rule off"}), (True, {"color": "#2471a3"})):
        samples = runs[release]["samples"]
        x = [s[0] for s in samples]
        label = style.pop("label", f"release rule on ({runs[release]['releases']} releases)")
        pool_axis.plot(x, [s[2] / 2**20 for s in samples], linewidth=1.4, label=label, **style)
        rss_axis.plot(x, [s[3] / 2**20 for s in samples], linewidth=1.4, label=label, **style)
    for axis in (pool_axis, rss_axis):
        for boundary in range(256, tokens + 1, 256):
            axis.axvline(boundary, color="#999999", linewidth=0.5, linestyle=":")
        axis.grid(axis="y", alpha=0.3)
    pool_axis.set_ylabel("MLX pool (MiB)")
    rss_axis.set_ylabel("process RSS (MiB)")
    rss_axis.set_xlabel("generated tokens (dotted: every 256, where the KV cache grows)")
    pool_axis.set_title(f"One speculative generation of {tokens} tokens (default pair, k = 3), pool cap lifted")
    pool_axis.legend(loc="upper left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(tokens: int = TOKENS, path: Path = FIGURE) -> None:
    runs = {release: measure(release, tokens) for release in (True, False)}
    figure(runs, path, tokens)
    print(f"### release rule: one speculative generation of {tokens} tokens (default pair, k = 3), pool cap lifted\n")
    print(f"![MLX's pool and RSS with the release rule on and off](figures/{path.name})\n")
    print("| release rule | releases | pool at most | pool at the end | RSS at most | RSS at the end |")
    print("| --- | --- | --- | --- | --- | --- |")
    for release in (True, False):
        samples = runs[release]["samples"]
        pools, rss = [s[2] for s in samples], [s[3] for s in samples]
        print(
            f"| {'on' if release else 'off'} | {runs[release]['releases']} | {max(pools) / 2**20:.0f} MiB "
            f"| {pools[-1] / 2**20:.0f} MiB | {max(rss) / 2**20:.0f} MiB | {rss[-1] / 2**20:.0f} MiB |"
        )
    print()
