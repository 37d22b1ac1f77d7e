"""Runner groups (``ranks``, runner/group.py): the default pair's target split across two processes over MLX's
ring backend on loopback, served by a real supervisor. Greedy answers equal one process's (plain, draft-model
and n-gram speculation), each rank holds about half the target's weights, 16 concurrent clients get what they
get alone, the release rule still releases at the crossing; a rank killed with SIGKILL takes the group down
and the supervisor brings it back, and nothing is left behind; a model that cannot be split is refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
from mlx.utils import tree_flatten

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, GEMMA3_DIR, SMOLLM2_DIR
from common.footprint import ModelFootprint
from common.protocol import runner_pb2, runner_pb2_grpc
from common.settings import RunnerSettings, SettingsError
from runner.request import GenerationRequest
from tests.processes import RunnerProcess, SupervisorProcess, child_environment, free_port, model_toml, wait_until

PROMPTS = (
    "The for statement is used to iterate over",
    "A class definition defines a class object",
    "The import statement",
    "Exceptions are raised when",
)


@pytest.fixture(scope="module")
def group_supervisor(tmp_path_factory):
    """One supervisor with four groups of 2 ranks: the default pair tensor parallel ("pair2") and pipelined
    ("pipe2"), SmolLM2 (9 heads: pipelined by "auto"), and the default pair across "hosts" ("hosts2": a
    hostfile on loopback, rank 1 under ``python -m supervisor worker``, as a second host would run it)."""
    folder = tmp_path_factory.mktemp("group")
    hostfile = folder / "hostfile.json"
    hostfile.write_text(json.dumps([[f"localhost:{free_port()}"], [f"127.0.0.1:{free_port()}"]]))
    models = model_toml("pair2", ranks=2) + model_toml("pipe2", ranks=2, parallelism="pipeline")
    models += model_toml("hosts2", ranks=2, hostfile=str(hostfile))
    # 8 layers on 3 ranks (3, 3, 2), and a prompt cache that holds two of the entries below.
    models += model_toml("pipe3", ranks=3, parallelism="pipeline", prompt_cache="5MiB")
    if SMOLLM2_DIR.is_dir():
        models += model_toml("smol2", target=SMOLLM2_DIR, draft=None, ranks=2)
    sup = SupervisorProcess(folder, models)
    worker = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "worker", "--config", str(sup.config), "--model", "hosts2", "--rank", "1"],
        stderr=open(folder / "worker.stderr", "w"),
        env=child_environment(),
    )
    sup.worker, sup.worker_stderr = worker, folder / "worker.stderr"
    try:
        sup.wait_ready(240)
    except BaseException:
        worker.kill()
        raise
    yield sup
    pids = [sup.process.pid, worker.pid] + [p for m in sup.client.get_status().models for p in ranks_of(sup, m.name)]
    pids += [c.pid for c in psutil.Process(worker.pid).children()]
    assert sup.stop() == 0
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def ranks_of(sup: SupervisorProcess, model: str = "pair2") -> list[int]:
    """The group's processes on this host started by the supervisor: rank 0 (its runner) and its followers."""
    runner = psutil.Process(sup.client.model(model).pid)
    return [runner.pid] + [c.pid for c in runner.children()]


def info(sup: SupervisorProcess, model: str):
    with grpc.insecure_channel(f"unix://{sup.runtime_dir}/{model}.sock") as channel:
        return runner_pb2_grpc.RunnerStub(channel).Info(runner_pb2.InfoRequest(), timeout=5)


def alone(engine, prompt: str, tokens: int, **fields) -> list[int]:
    out = []
    for chunk in engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True, **fields)):
        out += chunk.token_ids
    return out


def served(sup: SupervisorProcess, prompt: str, tokens: int, model: str = "pair2", **fields):
    ids, last = [], None
    for last in sup.client.generate(
        model=model, prompt=prompt, max_tokens=tokens, ignore_eos=True, timeout=300, **fields
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
    got = info(group_supervisor, "pair2")
    assert got.ranks == 2 and list(got.rank_pids) == pids[1:]
    assert (got.parallelism, got.group_backend) == ("tensor", "ring")
    holds_about_half(got, engine)
    # Idle, the other rank waits off MLX's ring (where a waiting rank polls a whole core): it sleeps.
    follower = psutil.Process(pids[1])
    before = sum(follower.cpu_times()[:2])
    time.sleep(2)
    assert sum(follower.cpu_times()[:2]) - before < 0.3


def holds_about_half(got, engine) -> None:
    """Each rank holds about half the target's float32 layers (the embeddings and head whole) and the whole
    draft; one process holds all of both."""
    target = ModelFootprint.of(DEFAULT_TARGET)
    layers = target.float32_bytes - target.unsplit_float32_bytes
    whole = sum(v.nbytes for m in (engine.target.model, engine.draft.model) for _, v in tree_flatten(m.parameters()))
    assert len(got.rank_memory) == 2
    for held in got.rank_memory:
        assert held < whole - 0.4 * layers, (held, whole, layers)


def test_a_pipelined_group_answers_as_one_process_does(group_supervisor, engine):
    for drafter in ("none", "model", "ngram"):
        expected = alone(engine, PROMPTS[0], 264, drafter=drafter, cache_prompt=False)
        tokens, stats = served(group_supervisor, PROMPTS[0], 264, model="pipe2", drafter=drafter)
        assert tokens == expected, drafter
        assert list(stats.release_positions)[0] >= 256 and stats.releases >= 2
        if drafter != "none":
            assert stats.drafted > stats.accepted > 0
    got = info(group_supervisor, "pipe2")
    assert got.parallelism == "pipeline" and got.ranks == 2
    holds_about_half(got, engine)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    expected = {p: served(group_supervisor, p, 24, model="pipe2")[0] for p in dict.fromkeys(prompts)}
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: served(group_supervisor, p, 24, model="pipe2")[0], prompts))
    assert together == [expected[p] for p in prompts]


def test_ranks_with_runs_of_different_lengths_keep_the_same_prompt_cache(group_supervisor, engine):
    """A prompt cache that evicts: every rank must hit and miss alike (a rank holding 2 layers counts its entries
    as a whole model's bytes, as do those holding 3), or their forward passes stop matching."""
    first, second, third, fourth = PROMPTS
    pid = group_supervisor.client.model("pipe3").pid
    for prompt in [first, first + " a list", second, third, fourth, fourth + " by", second + " it", first]:
        assert served(group_supervisor, prompt, 16, model="pipe3")[0] == alone(engine, prompt, 16, cache_prompt=False)
    with grpc.insecure_channel(f"unix://{group_supervisor.runtime_dir}/pipe3.sock") as channel:
        stats = runner_pb2_grpc.RunnerStub(channel).Memory(runner_pb2.MemoryRequest(), timeout=5).prompt_cache
    assert stats.evictions >= 2 and stats.hits >= 1, stats
    assert group_supervisor.client.model("pipe3").pid == pid  # the group never broke (and was never restarted)
    assert info(group_supervisor, "pipe3").ranks == 3


def test_smollm2_which_tensor_parallelism_cannot_split_is_pipelined(group_supervisor):
    if not SMOLLM2_DIR.is_dir():
        pytest.skip("make real-model fetches SmolLM2")
    from runner.engine import Engine

    smol = Engine.load(SMOLLM2_DIR, None, RunnerSettings())
    try:
        for prompt in PROMPTS[:2]:
            assert served(group_supervisor, prompt, 48, model="smol2")[0] == alone(smol, prompt, 48, cache_prompt=False)
    finally:
        del smol
    got = info(group_supervisor, "smol2")
    assert got.parallelism == "pipeline" and got.ranks == 2
    # Each rank: the embeddings (whole) and half of the 30 layers.
    footprint = ModelFootprint.of(SMOLLM2_DIR)
    half = footprint.unsplit_float32_bytes + (footprint.float32_bytes - footprint.unsplit_float32_bytes) * 0.6
    assert all(held < half for held in got.rank_memory), (list(got.rank_memory), footprint.float32_bytes)


def test_a_group_across_hosts_answers_and_outlives_a_killed_worker_rank(group_supervisor, engine):
    sup = group_supervisor
    expected = alone(engine, PROMPTS[3], 264, cache_prompt=False)
    tokens, stats = served(sup, PROMPTS[3], 264, model="hosts2")
    assert tokens == expected and list(stats.release_positions)[0] >= 256
    got = info(sup, "hosts2")
    assert got.ranks == 2 and list(got.rank_pids) == []  # rank 1 is the worker's, not this runner's child
    (rank,) = psutil.Process(sup.worker.pid).children()
    leader = sup.client.model("hosts2").pid
    stream = sup.client.generate(model="hosts2", prompt=PROMPTS[1], max_tokens=400, ignore_eos=True, timeout=300)
    first = len(next(stream).token_ids)
    rank.send_signal(signal.SIGKILL)
    # Rank 0's next collective fails at once: it exits, the supervisor restarts it, the worker starts rank 1
    # again, the group forms again and the answer is resumed (or failed, clearly).
    try:
        assert first + sum(len(chunk.token_ids) for chunk in stream) == 400
    except grpc.RpcError as error:
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), error
    assert sup.client.model("hosts2").pid != leader
    assert wait_until(lambda: len(psutil.Process(sup.worker.pid).children()) == 1, 30)
    assert psutil.Process(sup.worker.pid).children()[0].pid != rank.pid
    assert len(served(sup, PROMPTS[2], 32, model="hosts2")[0]) == 32
    assert "ended with -9; starting it again" in sup.worker_stderr.read_text()
    # Idle, rank 0 watches the other ranks' doorbell connections: a rank killed now restarts the group at once,
    # not when the next request finds it gone.
    leader = sup.client.model("hosts2").pid
    psutil.Process(sup.worker.pid).children()[0].send_signal(signal.SIGKILL)
    assert wait_until(lambda: sup.client.model("hosts2").pid not in (0, leader), 20)
    assert len(served(sup, PROMPTS[0], 8, model="hosts2")[0]) == 8


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
    runner = RunnerProcess(
        tmp_path / "smol", "--ranks", "2", "--parallelism", "tensor", target=SMOLLM2_DIR, draft=None, name="smol"
    )
    assert runner.process.wait(120) == 2
    problems = [line for line in runner.stderr.splitlines() if line.startswith("runner:")]
    assert len(problems) == 1 and problems[0].endswith(
        "cannot be split across 2 processes by tensor parallelism: its 9 attention heads cannot be split 2 ways"
    )


def test_auto_takes_tensor_where_it_splits_else_pipeline_else_says_both_reasons():
    from runner.group import GroupError, choose_parallelism

    assert choose_parallelism(DEFAULT_TARGET, 2) == "tensor"
    assert choose_parallelism(DEFAULT_TARGET, 8) == "pipeline"  # 6 heads do not split 8 ways; 8 layers do
    assert choose_parallelism(DEFAULT_TARGET, 2, "pipeline") == "pipeline"
    with pytest.raises(
        GroupError,
        match="tensor parallel: its 4 attention heads cannot be split 8 ways.*"
        "pipeline: its 2 layers cannot be split 8 ways",
    ):
        choose_parallelism(DEFAULT_DRAFT, 8)  # the draft: 4 heads, 2 layers
    if GEMMA3_DIR.is_dir():  # sliding-window layers, no shard(): neither way
        with pytest.raises(GroupError, match=r"has no shard\(\)\); pipeline: mlx-lm has no pipeline for a gemma3_text"):
            choose_parallelism(GEMMA3_DIR, 2)


def test_settings_a_group_cannot_take_are_refused_naming_the_key(tmp_path):
    three = tmp_path / "three.json"
    three.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"], ["127.0.0.1:3"]]))
    (tmp_path / "bad.json").write_text('{"rank0": "127.0.0.1:1"}')
    for fields, key in (
        ({"ranks": 9}, "ranks"),
        ({"ranks": 2, "prompt_cache_dir": tmp_path}, "ranks"),
        ({"ranks": 2, "prompt_cache_cold_after": 5.0}, "ranks"),
        ({"ranks": 2, "hostfile": three}, "hostfile"),
        ({"ranks": 2, "hostfile": tmp_path / "bad.json"}, "hostfile"),
        ({"ranks": 2, "hostfile": tmp_path / "missing.json"}, "hostfile"),
        ({"ranks": 2, "backend": "mpi"}, "backend"),
        ({"ranks": 2, "parallelism": "expert"}, "parallelism"),
        ({"ranks": 2, "backend": "nccl", "parallelism": "pipeline"}, "parallelism"),
    ):
        with pytest.raises(SettingsError) as caught:
            RunnerSettings(**fields)
        assert caught.value.key == key, fields


def test_a_backend_this_mlx_lacks_fails_the_start_with_one_line(tmp_path):
    import mlx.core as mx

    if mx.distributed.is_available(backend="nccl"):
        pytest.skip("this MLX has NCCL")
    runner = RunnerProcess(tmp_path / "nccl", "--ranks", "2", "--backend", "nccl", name="nccl")
    assert runner.process.wait(120) == 2
    problems = [line for line in runner.stderr.splitlines() if line.startswith("runner:")]
    assert problems == ["runner: MLX here has no nccl backend (backend = 'nccl')"]


def test_a_worker_takes_its_rank_from_a_leaderworkerset(tmp_path):
    from supervisor.config import ConfigError, load
    from supervisor.worker import WorkerError, lws_hostfile, worker_rank

    env = {"LWS_LEADER_ADDRESS": "mlx-0.mlx.serving", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "2"}
    hosts = lws_hostfile(env, 32323)
    assert hosts == [["mlx-0.mlx.serving:32323"], ["mlx-0-1.mlx.serving:32323"], ["mlx-0-2.mlx.serving:32323"]]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(hosts))
    config = tmp_path / "c.toml"
    config.write_text(model_toml("big", ranks=3, hostfile="hosts.json").replace("'", '"') + model_toml("one"))
    model = load(config).models["big"]
    assert model.runner.hostfile == hostfile  # relative to the config's folder
    assert worker_rank(model, None, env) == 2
    assert worker_rank(model, 1, {}) == 1
    with pytest.raises(WorkerError, match="rank 0 is the leader's"):
        worker_rank(model, 0, {})
    with pytest.raises(ConfigError) as caught:
        worker_rank(model, None, {**env, "LWS_GROUP_SIZE": "4"})
    assert caught.value.key == "models.big.ranks"
    with pytest.raises(ConfigError):
        worker_rank(load(config).models["one"], 1, {})
    with pytest.raises(WorkerError, match="LWS_LEADER_ADDRESS"):
        lws_hostfile({}, 1)


def test_the_estimate_counts_every_rank():
    from common.footprint import LOAD_SLACK, estimate

    target, draft = ModelFootprint.of(DEFAULT_TARGET), ModelFootprint.of(DEFAULT_DRAFT)
    one = estimate([target, draft], "float32", "cpu")
    two = estimate([target, draft], "float32", "cpu", ranks=2)
    # A draft each, and the target's embeddings and head (outside its layers) on every rank.
    extra = int(draft.weight_bytes("float32") * (1 + LOAD_SLACK)) + target.unsplit_float32_bytes * (1 + LOAD_SLACK)
    assert abs(two.weights - one.weights - extra) <= 2
    assert 0 < target.unsplit_float32_bytes < target.float32_bytes / 2
    # Across hosts, this host holds rank 0's share: about half the layers and cache, the embeddings, a draft.
    mine = estimate([target, draft], "float32", "cpu", ranks=2, here=1)
    assert one.weights * 0.5 < mine.weights < one.weights * 0.7 and mine.kv_cache < 0.6 * one.kv_cache
    assert mine.runtime == one.runtime
    assert two.kv_cache - one.kv_cache == draft.kv_bytes("float32", target.context_length)
    assert two.runtime == 2 * one.runtime and two.prefill == 2 * one.prefill
