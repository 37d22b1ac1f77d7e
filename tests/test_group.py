"""Runner groups (``ranks``, runner/group.py): the default pair's target split across two processes over MLX's
ring backend on loopback, served by a real supervisor. Greedy answers equal one process's (plain, draft-model
and n-gram speculation), each rank holds about half the target's weights, 16 concurrent clients get what they
get alone, the release rule still releases at the crossing; a rank killed with SIGKILL takes the group down
and the supervisor brings it back, and nothing is left behind; a model that cannot be split is refused."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from mlx.utils import tree_flatten

from common.defaults import DEFAULT_TARGET, SMOLLM2_DIR
from common.footprint import ModelFootprint
from common.protocol import runner_pb2, runner_pb2_grpc
from common.settings import RunnerSettings, SettingsError
from runner.request import GenerationRequest
from tests.processes import RunnerProcess, SupervisorProcess, model_toml

PROMPTS = (
    "The for statement is used to iterate over",
    "A class definition defines a class object",
    "The import statement",
    "Exceptions are raised when",
)


@pytest.fixture(scope="module")
def group_supervisor(tmp_path_factory):
    sup = SupervisorProcess(tmp_path_factory.mktemp("group"), model_toml("pair2", ranks=2)).wait_ready(180)
    yield sup
    pids = [sup.process.pid] + ranks_of(sup)
    assert sup.stop() == 0
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def ranks_of(sup: SupervisorProcess) -> list[int]:
    """The group's processes: rank 0 (the supervisor's runner) and its followers."""
    runner = psutil.Process(sup.client.get_status().models[0].pid)
    return [runner.pid] + [c.pid for c in runner.children()]


def alone(engine, prompt: str, tokens: int, **fields) -> list[int]:
    out = []
    for chunk in engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True, **fields)):
        out += chunk.token_ids
    return out


def served(sup: SupervisorProcess, prompt: str, tokens: int, **fields):
    ids, last = [], None
    for last in sup.client.generate(
        model="pair2", prompt=prompt, max_tokens=tokens, ignore_eos=True, timeout=300, **fields
    ):
        ids += last.token_ids
    return ids, last.stats


def test_a_group_answers_as_one_process_does_and_splits_the_weights(group_supervisor, engine):
    for drafter in ("none", "model", "ngram"):
        expected = alone(engine, PROMPTS[0], 264, drafter=drafter, cache_prompt=False)
        tokens, stats = served(group_supervisor, PROMPTS[0], 264, drafter=drafter)
        assert tokens == expected, drafter
        assert list(stats.release_positions)[0] >= 256 and stats.releases >= 2  # the crossing, and the end
        if drafter != "none":
            assert stats.drafted > stats.accepted > 0
    pids = ranks_of(group_supervisor)
    assert len(pids) == 2
    # The supervisor watches every rank: its memory view has each process's RSS.
    (status,) = group_supervisor.client.get_memory("pair2").models
    assert len(status.memory.process_rss) == 2 and all(rss > 50 * 2**20 for rss in status.memory.process_rss)
    with grpc.insecure_channel(f"unix://{group_supervisor.runtime_dir}/pair2.sock") as channel:
        info = runner_pb2_grpc.RunnerStub(channel).Info(runner_pb2.InfoRequest(), timeout=5)
    assert info.ranks == 2 and list(info.rank_pids) == pids[1:]
    # Each rank holds half the target's float32 weights and the whole draft (one process: all of both).
    target = ModelFootprint.of(DEFAULT_TARGET).parameters * 4
    whole = sum(v.nbytes for m in (engine.target.model, engine.draft.model) for _, v in tree_flatten(m.parameters()))
    for held in info.rank_memory:
        assert held < whole - 0.4 * target, (held, whole, target)


def test_sixteen_concurrent_clients_get_what_they_get_alone(group_supervisor):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    expected = {p: served(group_supervisor, p, 24)[0] for p in dict.fromkeys(prompts)}
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: served(group_supervisor, p, 24)[0], prompts))
    assert got == [expected[p] for p in prompts]


def test_a_killed_rank_takes_the_group_down_and_the_supervisor_brings_it_back(group_supervisor):
    before = ranks_of(group_supervisor)
    stream = group_supervisor.client.generate(
        model="pair2", prompt=PROMPTS[1], max_tokens=400, ignore_eos=True, timeout=300
    )
    first = len(next(stream).token_ids)  # decoding
    psutil.Process(before[1]).send_signal(signal.SIGKILL)
    # Rank 0's next collective fails at once ("connection to a peer was lost"), or its watch sees the death:
    # the runner exits, and the supervisor resumes the answer on the restarted group (or fails it, clearly).
    try:
        assert first + sum(len(chunk.token_ids) for chunk in stream) == 400
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), error
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            after = ranks_of(group_supervisor)
            if after[0] != before[0] and len(after) == 2:
                break
        except (psutil.Error, IndexError, grpc.RpcError):
            pass
        time.sleep(0.5)
    else:
        raise AssertionError("the group did not come back")
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in before)
    tokens, _ = served(group_supervisor, PROMPTS[2], 32)
    assert len(tokens) == 32
    log = group_supervisor.stderr
    assert "connection to a peer was lost" in log or "rank 1 of the group" in log


def test_a_model_that_cannot_be_split_is_refused_with_its_reason(tmp_path):
    if not SMOLLM2_DIR.is_dir():
        pytest.skip("make real-model fetches SmolLM2")
    runner = RunnerProcess(tmp_path / "smol", "--ranks", "2", target=SMOLLM2_DIR, draft=None, name="smol")
    assert runner.process.wait(120) == 2
    problems = [line for line in runner.stderr.splitlines() if line.startswith("runner:")]
    assert len(problems) == 1 and problems[0].endswith(
        "cannot be split across 2 processes: its 9 attention heads cannot be split 2 ways"
    )


def test_settings_a_group_cannot_take_are_refused_naming_the_key(tmp_path):
    for fields in (
        {"ranks": 9},
        {"ranks": 2, "prompt_cache_dir": tmp_path},
        {"ranks": 2, "prompt_cache_cold_after": 5.0},
    ):
        with pytest.raises(SettingsError) as caught:
            RunnerSettings(**fields)
        assert caught.value.key == "ranks"


def test_the_estimate_counts_every_rank():
    from common.defaults import DEFAULT_DRAFT
    from common.footprint import LOAD_SLACK, estimate

    target, draft = ModelFootprint.of(DEFAULT_TARGET), ModelFootprint.of(DEFAULT_DRAFT)
    one = estimate([target, draft], "float32", "cpu")
    two = estimate([target, draft], "float32", "cpu", ranks=2)
    assert two.weights - one.weights == int(draft.weight_bytes("float32") * (1 + LOAD_SLACK))  # a draft each
    assert two.kv_cache - one.kv_cache == draft.kv_bytes("float32", target.context_length)
    assert two.runtime == 2 * one.runtime and two.prefill == 2 * one.prefill
