"""The prompt cache: a six-turn chat with a ~1,500-token system prompt, cache on and off; malloc_trim's effect.

Each turn sends the whole conversation again (as chat clients do): the system
prompt, every earlier question and answer, and the new question. With the
prompt cache the runner prefills only what follows the longest cached prefix.
Figures are the runner's own (time to first token from its stats, RSS from its
Memory RPC after each turn), through a real runner process over gRPC.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.protocol import runner_pb2

QUESTIONS = (
    "What does the for statement do?",
    "And what happens to the else clause of a loop?",
    "How does the while statement differ from it?",
    "What does break do inside nested loops?",
    "When would you use continue instead?",
    "Summarise the four answers in one sentence.",
)
ANSWER_TOKENS = 48


def system_prompt(tokenizer, tokens: int = 1500) -> str:
    """Python's own reference text (pydoc topics), cut at ~``tokens`` tokens of this tokenizer."""
    text = "Answer questions about Python using only this reference.\n\n"
    for name in ("for", "while", "break", "continue", "if", "try", "with", "assignment", "import", "function"):
        text += topics[name] + "\n"
        if len(tokenizer.encode(text)) > tokens:
            break
    ids = tokenizer.encode(text)[:tokens]
    return tokenizer.decode(ids)


def conversation_requests(folder: Path, chat: bool, turns: int = len(QUESTIONS), answer_tokens: int = ANSWER_TOKENS):
    """One GenerateRequest per turn, built as the previous answers come back (a generator fed with answers)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(folder)
    system = system_prompt(tokenizer)
    history: list[tuple[str, str]] = [("system", system)]
    for question in QUESTIONS[:turns]:
        history.append(("user", question))
        request = runner_pb2.GenerateRequest(max_tokens=answer_tokens, ignore_eos=True)
        if chat:
            for role, content in history:
                request.messages.add(role=role, content=content)
        else:
            request.prompt = "".join(f"{role.title()}: {content}\n\n" for role, content in history) + "Assistant:"
        answer = yield request
        history.append(("assistant", answer))


def run_chat(folder: Path, draft, chat: bool, cache: bool, turns: int, answer_tokens: int) -> list[dict]:
    from tests.processes import RunnerProcess

    extra = [] if cache else ["--prompt-cache", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        runner = RunnerProcess(Path(tmp) / "sockets", *extra, target=folder, draft=draft, name="bench").wait_serving(
            300
        )
        measured = []
        try:
            requests = conversation_requests(folder, chat, turns, answer_tokens)
            request = next(requests)
            while True:
                chunks = list(runner.client.stub.Generate(request, timeout=900))
                stats = chunks[-1].stats
                memory = runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5)
                measured.append(
                    {
                        "prompt": stats.prompt_tokens,
                        "cached": stats.cached_tokens,
                        "ttft": stats.time_to_first_token_s,
                        "rss": memory.rss,
                        "cache_bytes": memory.prompt_cache.bytes,
                    }
                )
                try:
                    request = requests.send("".join(c.text for c in chunks))
                except StopIteration:
                    break
        finally:
            runner.stop()
    return measured


def malloc_trim_rss(trim: bool) -> list[int]:
    """RSS after each of four 2000-token generations on the default pair."""
    from tests.processes import RunnerProcess

    extra = [] if trim else ["--no-malloc-trim"]
    prompts = (
        "The for statement is used to iterate",
        "A class definition defines a class object",
        "Assignment statements are used to",
        "The import statement",
    )
    with tempfile.TemporaryDirectory() as tmp:
        runner = RunnerProcess(Path(tmp) / "sockets", "--prompt-cache", "0", *extra).wait_serving(120)
        rss = []
        try:
            for prompt in prompts:
                list(runner.client.generate(timeout=900, prompt=prompt, max_tokens=2000, ignore_eos=True))
                rss.append(runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).rss)
        finally:
            runner.stop()
    return rss


def disk_tier_runs(folder: Path, draft, prompt: list[int]) -> dict:
    """A ~3000-token prefix: its cold prefill, a hit in memory, and a hit from disk after kill -9 and a restart."""
    import signal

    from tests.processes import RunnerProcess

    def first_token(runner, suffix: int):
        chunks = list(
            runner.client.generate(timeout=900, prompt_ids=prompt + [suffix, suffix + 1], max_tokens=2, ignore_eos=True)
        )
        return chunks[-1].stats

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cold = RunnerProcess(tmp / "cold", "--prompt-cache", "0", target=folder, draft=draft).wait_serving(300)
        try:
            first_token(cold, 300)  # warm-up: the first prefill of a process pays for its kernels
            cold_stats = first_token(cold, 310)
        finally:
            cold.stop()
        dir_args = ("--prompt-cache-dir", str(tmp / "prompts"))
        before = RunnerProcess(tmp / "before", *dir_args, target=folder, draft=draft).wait_serving(300)
        first_token(before, 320)
        memory_stats = first_token(before, 330)
        written = before.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache
        before.process.send_signal(signal.SIGKILL)
        before.process.wait(30)
        after = RunnerProcess(tmp / "after", *dir_args, target=folder, draft=draft).wait_serving(300)
        try:
            disk_stats = first_token(after, 340)
            read = after.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache
        finally:
            after.stop()
    return {
        "prompt": cold_stats.prompt_tokens,
        "cold": cold_stats.time_to_first_token_s,
        "memory": memory_stats.time_to_first_token_s,
        "disk": disk_stats.time_to_first_token_s,
        "cached": disk_stats.cached_tokens,
        "file": read.disk_bytes,
        "write": written.disk_write_s / max(written.disk_writes, 1),
        "read": read.disk_read_s,
    }


def answer(runner, prompt_ids: list[int], tokens: int):
    ids, last = [], None
    for last in runner.client.generate(timeout=900, prompt_ids=prompt_ids, max_tokens=tokens, ignore_eos=True):
        ids += last.token_ids
    return ids, last.stats


def cold_tier_runs(folder: Path, draft, prompt: list[int], suffixes: list[list[int]], tokens: int = 64) -> dict:
    """A ~3000-token prefix: its cold prefill, then a hit on its entry once the entry has gone cold
    (``--prompt-cache-cold-after 2s``): times to first token, the entry's float and cold bytes, and how many
    of the hit's greedy tokens equal the cold prefill's."""
    from tests.processes import RunnerProcess

    first, follow_up = (prompt + suffix for suffix in suffixes)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        reference = RunnerProcess(tmp / "ref", "--prompt-cache", "0", target=folder, draft=draft).wait_serving(300)
        try:
            answer(reference, first, 2)  # warm-up: the first prefill of a process pays for its kernels
            expected, cold = answer(reference, follow_up, tokens)
        finally:
            reference.stop()
        tier = RunnerProcess(tmp / "tier", "--prompt-cache-cold-after", "2s", target=folder, draft=draft).wait_serving(
            300
        )
        try:
            answer(tier, first, 2)
            float_bytes = tier.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache.bytes
            time.sleep(2.5)
            got, hit = answer(tier, follow_up, tokens)
            stats = tier.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache
        finally:
            tier.stop()
    return {
        "prompt": cold.prompt_tokens,
        "cold": cold.time_to_first_token_s,
        "hit": hit.time_to_first_token_s,
        "cached": hit.cached_tokens,
        "cold_hits": stats.cold_hits,
        "float_bytes": float_bytes,
        "cold_bytes": stats.cold_bytes,
        "agree": next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), len(expected)),
        "tokens": len(expected),
    }


def cold_tier_table() -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    print(
        "\n### prompt cache cold tier: a hit on a 3000-token entry (Python's reference text) after it went cold "
        "(8-bit, groups of 64)\n"
    )
    print(
        "| model | time to first token: cold prefill | cold-tier hit | hit vs cold | from the cache "
        "| entry: float | cold | float / cold | greedy tokens equal to the cold prefill's |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, folder, draft in (
        ("default pair", DEFAULT_TARGET, DEFAULT_DRAFT),
        ("SmolLM2 (float32)", SMOLLM2_DIR, None),
    ):
        tokenizer = load_tokenizer(folder)
        prefix = tokenizer.encode(system_prompt(tokenizer, 4000))[:3000]
        questions = (
            "\n\nQuestion: What does break do?\nAnswer:",
            "\n\nQuestion: When does a loop's else run?\nAnswer:",
        )
        r = cold_tier_runs(folder, draft, prefix, [tokenizer.encode(q, add_special_tokens=False) for q in questions])
        assert r["cold_hits"] == 1, r
        agree = "all" if r["agree"] == r["tokens"] else f"the first {r['agree']}"
        print(
            f"| {label} | {r['cold'] * 1000:.0f} ms | {r['hit'] * 1000:.0f} ms | {r['hit'] / r['cold']:.0%} "
            f"| {r['cached']} of {r['prompt']} | {r['float_bytes'] / 2**20:.1f} MiB | {r['cold_bytes'] / 2**20:.1f} MiB "
            f"| {r['float_bytes'] / r['cold_bytes']:.2f}x | {agree} of {r['tokens']} |"
        )
    print()


def disk_tier_table() -> None:
    import random

    prefix = random.Random(5).choices(range(10, 4000), k=3000)
    print("\n### prompt cache disk tier: a 3000-token prefix after kill -9 and a restart of the runner\n")
    print(
        "| model | time to first token: cold | memory hit | disk hit after the restart | disk hit vs cold "
        "| from the cache | file | write (per entry) | check and load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, folder, draft in (
        ("default pair", DEFAULT_TARGET, DEFAULT_DRAFT),
        ("SmolLM2 (float32)", SMOLLM2_DIR, None),
    ):
        r = disk_tier_runs(folder, draft, prefix)
        print(
            f"| {label} | {r['cold'] * 1000:.0f} ms | {r['memory'] * 1000:.0f} ms | {r['disk'] * 1000:.0f} ms "
            f"| {r['disk'] / r['cold']:.0%} | {r['cached']} of {r['prompt']} | {r['file'] / 2**20:.0f} MiB "
            f"| {r['write'] * 1000:.0f} ms | {r['read'] * 1000:.0f} ms |"
        )
    print()


def run(quick: bool = False, malloc_table: bool = True, figure: Path | None = None, disk_table: bool = True) -> None:
    """``quick``: two turns of 8-token answers (bench/device.py on a CPU); ``malloc_table``: the RSS that
    malloc_trim returns (host memory: bench/device.py leaves it out)."""
    turns, answer = (2, 8) if quick else (len(QUESTIONS), ANSWER_TOKENS)
    print(f"## prompt cache: {turns}-turn chat, ~1,500-token system prompt, {answer}-token answers\n")
    print(
        "| model | cache | turn | prompt tokens | from the cache | time to first token | vs turn 1 | RSS after the turn |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    summary, series = [], {}
    for label, folder, draft, chat in (
        ("SmolLM2 (chat template)", SMOLLM2_DIR, None, True),
        ("default pair (plain text turns)", DEFAULT_TARGET, DEFAULT_DRAFT, False),
    ):
        for cache in (False, True):
            measured = run_chat(folder, draft, chat, cache, turns, answer)
            cold = measured[0]["ttft"]
            for n, t in enumerate(measured, 1):
                print(
                    f"| {label} | {'on' if cache else 'off'} | {n} | {t['prompt']} | {t['cached']} | "
                    f"{t['ttft'] * 1000:.0f} ms | {t['ttft'] / cold:.0%} | {t['rss'] / 2**20:.0f} MiB |"
                )
            series.setdefault(label, []).append(
                (
                    f"prompt cache {'on' if cache else 'off'}",
                    [t["prompt"] for t in measured],
                    [t["ttft"] * 1000 for t in measured],
                )
            )
            later = [t["ttft"] / cold for t in measured[1:]]
            summary.append((label, cache, statistics.mean(later), max(later)))
    from .figures import FIGURES, line_figure

    path = line_figure(
        figure or FIGURES / "prompt_cache.png",
        f"Time to first token as a {turns}-turn chat grows, prompt cache on and off",
        [
            {
                "title": label,
                "x": "prompt tokens (the whole conversation)",
                "y": "time to first token (ms)",
                "series": lines,
                "log_y": True,
            }
            for label, lines in series.items()
        ],
    )
    print(f"\n![Time to first token against prompt length, prompt cache on and off](figures/{path.name})")
    print(f"\n| model | cache | turns 2-{turns}: mean time to first token vs turn 1 | worst |")
    print("| --- | --- | --- | --- |")
    for label, cache, mean, worst in summary:
        print(f"| {label} | {'on' if cache else 'off'} | {mean:.0%} | {worst:.0%} |")
    if disk_table and not quick:
        disk_tier_table()
        cold_tier_table()
    if quick or not malloc_table:
        return
    with_trim, without = malloc_trim_rss(True), malloc_trim_rss(False)
    print(
        "\n### malloc_trim after pool releases: runner RSS after each of four 2000-token generations (default pair)\n"
    )
    print("| generation | with malloc_trim | without | returned |")
    print("| --- | --- | --- | --- |")
    for n, (a, b) in enumerate(zip(with_trim, without), 1):
        print(f"| {n} | {a / 2**20:.0f} MiB | {b / 2**20:.0f} MiB | {(b - a) / 2**20:.0f} MiB |")
    print()
