"""The prompt cache's disk tier (runner/prompt_disk.py): warm prefixes survive a kill -9 of the runner, files cut
short or from another model are logged and ignored, and the disk budget holds.

Real runner processes on the default pair, one folder per test; a 3000-token prefix as an agent's system prompt
and tool definitions would be.
"""

from __future__ import annotations

import json
import random
import shutil
import signal

from common.protocol import runner_pb2
from tests.processes import RunnerProcess

PREFIX = random.Random(7).choices(range(10, 4000), k=3000)


def answer(runner: RunnerProcess, prompt_ids: list[int], max_tokens: int = 12) -> tuple[list[int], object]:
    chunks = list(runner.client.generate(timeout=120, prompt_ids=prompt_ids, max_tokens=max_tokens, ignore_eos=True))
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats


def disk_stats(runner: RunnerProcess):
    return runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache


def files(folder) -> list:
    return sorted(p for p in folder.rglob("*.safetensors"))


def test_a_warm_prefix_survives_kill_9_and_a_restart(tmp_path):
    cold = RunnerProcess(tmp_path / "cold", "--prompt-cache", "0").wait_serving()
    try:
        expected, stats = answer(cold, PREFIX + [11, 12])
        assert stats.cached_tokens == 0
    finally:
        cold.stop()
    folder = tmp_path / "prompts"
    first = RunnerProcess(tmp_path / "first", "--prompt-cache-dir", str(folder)).wait_serving()
    answer(first, PREFIX + [21, 22])  # its entry is written as the request ends
    assert disk_stats(first).disk_entries == 1 and len(files(folder)) == 1
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(10)
    second = RunnerProcess(tmp_path / "second", "--prompt-cache-dir", str(folder)).wait_serving()
    try:
        tokens, stats = answer(second, PREFIX + [11, 12])
        assert stats.cached_tokens == len(PREFIX)  # the shared prefix came back from disk...
        assert tokens == expected  # ...and gives the tokens a cold prefill gives
        cache = disk_stats(second)
        assert cache.disk_hits == 1 and cache.disk_failures == 0
    finally:
        assert second.stop() == 0


def test_a_cut_short_file_and_another_models_file_are_logged_and_ignored(tmp_path):
    folder = tmp_path / "prompts"
    other = RunnerProcess(tmp_path / "other", "--prompt-cache-dir", str(folder), draft=None).wait_serving()
    try:
        answer(other, PREFIX + [31])
    finally:
        assert other.stop() == 0
    (theirs,) = files(folder)  # in the folder of the target without its draft
    pair = RunnerProcess(tmp_path / "pair", "--prompt-cache-dir", str(folder)).wait_serving()
    try:
        expected, _ = answer(pair, PREFIX + [41])
    finally:
        assert pair.stop() == 0
    ours = [f for f in files(folder) if f.parent != theirs.parent]
    assert len(ours) == 1
    data = ours[0].read_bytes()
    ours[0].write_bytes(data[: len(data) // 2])  # a file cut short (a disk that filled up, a copy interrupted)
    shutil.copy(theirs, ours[0].parent / theirs.name)  # and one from a model without the draft
    again = RunnerProcess(tmp_path / "again", "--prompt-cache-dir", str(folder)).wait_serving()
    try:
        tokens, stats = answer(again, PREFIX + [41])
        assert stats.cached_tokens == 0 and tokens == expected  # neither file was used; the answer is right
        assert disk_stats(again).disk_failures == 2
    finally:
        assert again.stop() == 0
    log = again.stderr
    assert "another model's cache" in log and theirs.name in log
    assert f"{ours[0]} is not a whole cache" in log or f"{ours[0]} is unreadable" in log  # and removed...
    # ...then written whole again as the request ended: one file of this prompt's entry that loads whole. (Not the
    # same bytes: where its last round left the draft's cache, and so whether the entry holds it and how many
    # tokens, depends on the rounds the adaptive depth chose, which depend on timing.)
    from mlx_lm.models.cache import load_prompt_cache

    again_written = [f for f in files(folder) if f.parent == ours[0].parent and f.name != theirs.name]
    assert len(again_written) == 1
    layers, metadata = load_prompt_cache(str(again_written[0]), return_metadata=True)
    assert json.loads(metadata["tokens"])[: len(PREFIX) + 1] == PREFIX + [41] and len(layers) >= 8
    assert (ours[0].parent / theirs.name).exists()  # the other model's was left alone


def test_the_disk_budget_holds(tmp_path):
    folder = tmp_path / "prompts"
    probe = RunnerProcess(tmp_path / "probe", "--prompt-cache-dir", str(folder / "probe")).wait_serving()
    try:
        answer(probe, PREFIX[:600], max_tokens=4)
        one = disk_stats(probe).disk_bytes
    finally:
        assert probe.stop() == 0
    budget = int(2.5 * one)
    runner = RunnerProcess(
        tmp_path / "budget", "--prompt-cache-dir", str(folder / "kept"), "--prompt-cache-disk", str(budget)
    ).wait_serving()
    try:
        for start in range(0, 2400, 600):  # four different 600-token prompts, each one entry
            answer(runner, PREFIX[start : start + 600], max_tokens=4)
        cache = disk_stats(runner)
        assert cache.disk_entries == 2 and cache.disk_bytes <= budget
        assert sum(f.stat().st_size for f in files(folder / "kept")) <= budget
    finally:
        assert runner.stop() == 0
