"""The real supervisor with real runners: serving, crashes, probes, shutdown."""

import os
import re
import signal
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2

from common.defaults import MINILM_DIR
from supervisor.client import format_models
from supervisor.protocol import supervisor_pb2
from tests.processes import SupervisorProcess, model_toml, resumed_on_a_new_runner, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
PROMPT = "The for statement is used to iterate over the elements of a sequence"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    # beta's MLX thread counts as hung after 1 s without progress (the default is 30 s); its chunks may be as
    # long as a GPU's, so what splits its prefill is the time limit
    sup = SupervisorProcess(
        tmp_path_factory.mktemp("two"), model_toml("alpha") + model_toml("beta", stall_after="1s", prefill_chunk=2048)
    ).wait_ready()
    yield sup
    assert sup.stop() == 0


def generate(sup, **fields):
    chunks = list(sup.client.generate(timeout=120, **fields))
    return "".join(c.text for c in chunks), chunks[-1]


def test_both_models_generate_at_once_and_report_memory(two_models):
    sup = two_models
    results = {}

    def run(model):
        results[model] = generate(sup, model=model, prompt=PROMPT, max_tokens=300, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["alpha"][0] == results["beta"][0]  # same pair, greedy: same text
    assert results["alpha"][1].stats.generated_tokens == 300
    models = {m.name: m for m in sup.client.list_models().models}
    assert {m.state for m in models.values()} == {supervisor_pb2.RUNNER_STATE_SERVING}
    assert models["alpha"].pid != models["beta"].pid and models["alpha"].pid in sup.runner_pids()
    # Each runner is told where MLX's compiled GPU kernels are kept (kernel_cache_dir), and the folder is there.
    for pid in sup.runner_pids():
        assert psutil.Process(pid).environ()["MLX_PTX_CACHE_DIR"] == str(sup.kernel_cache_dir)
    assert sup.kernel_cache_dir.is_dir()
    # warm-up's release, the boundary at 256 and the end of the request, once the watch samples again
    assert wait_until(
        lambda: all(
            m.memory.history_samples > 1 and m.memory.mlx_releases >= 3 for m in sup.client.get_memory().models
        ),
        10,
    )
    for m in sup.client.get_memory().models:
        s = m.memory
        assert s.rss > s.anonymous > s.mlx_active > 0
        assert 50 * 2**20 < s.rss < 2 * 2**30 and s.peak_rss >= s.rss
    status, body = sup.probe("/metrics")
    assert status == 200 and 'mlxserve_runner_rss_bytes{model="alpha"}' in body
    assert 'mlxserve_requests_total{code="OK",model="beta"}' in body
    # The log: one record a line, one timestamp each; the runners' records name their model and pid.
    pids = {m.name: m.pid for m in models.values()}
    lines = sup.stderr.splitlines()
    for name in ("alpha", "beta"):
        started = [line for line in lines if f"INFO runner[{name}:{pids[name]}] serving {name} after" in line]
        assert len(started) == 1, lines[:20]
    stamped = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line)]
    assert all(len(re.findall(r"\d\d:\d\d:\d\d,\d{3}", line)) == 1 for line in stamped)
    assert PROMPT not in body and results["alpha"][0][:40] not in body  # no prompts or outputs
    assert sup.probe("/readyz")[0] == 200 and sup.probe("/healthz") == (200, "ok\n")
    assert sup.client.health_status("alpha") == SERVING and sup.client.health_status("beta") == SERVING


def test_unknown_model_and_bad_fields(two_models):
    with pytest.raises(grpc.RpcError) as caught:
        generate(two_models, model="gamma", prompt="x", max_tokens=3)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "gamma" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        generate(two_models, model="alpha", prompt="x", max_tokens=3, top_p=3.0)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in caught.value.details()
    assert generate(two_models, model="alpha", prompt="x", max_tokens=3, ignore_eos=True)[1].stats.generated_tokens == 3


def test_a_prefill_longer_than_stall_after_is_not_a_hang(two_models):
    """A prompt whose prefill takes several times beta's stall_after gets its answer, with no restart."""
    sup = two_models
    before = sup.client.model("beta")
    ids = [100 + (i * 7) % 3000 for i in range(3000)]
    chunks = list(sup.client.generate(timeout=300, model="beta", prompt_ids=ids, max_tokens=8, ignore_eos=True))
    stats = chunks[-1].stats
    assert stats.generated_tokens == 8
    assert stats.prefill_s > 2.0, stats.prefill_s
    assert len(stats.prefill_chunks) > 3 and sum(stats.prefill_chunks) == len(ids) - 1
    after = sup.client.model("beta")
    assert after.restarts == before.restarts and after.pid == before.pid
    assert "hung" not in sup.stderr


def test_runner_killed_mid_stream_twice_gives_unavailable_and_is_restarted(two_models):
    """The first death mid-stream is resumed on the restarted runner (test_reliability); the second ends the
    request at once, the cause first."""
    sup = two_models
    victim = sup.client.model("alpha")
    health_seen = []
    watching = threading.Event()

    def watch_health():
        while not watching.is_set():
            status = sup.client.health_status("alpha", timeout=0.5)
            if not health_seen or health_seen[-1] != status:
                health_seen.append(status)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    call = sup.client.generate(timeout=120, model="alpha", prompt=PROMPT, max_tokens=4000, ignore_eos=True)
    next(call)
    os.kill(victim.pid, signal.SIGKILL)
    os.kill(resumed_on_a_new_runner(sup, "alpha", victim.pid), signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert time.monotonic() - killed_at < 1.5
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details().startswith("model alpha: runner killed by SIGKILL")  # the cause first
    assert " INFO " not in caught.value.details()  # the runner's log lines are not a cause
    assert sup.client.wait_serving(60, service="alpha")
    assert wait_until(lambda: health_seen[-1] == SERVING, 5)  # the watcher saw it too
    watching.set()
    watcher.join()
    assert SERVING in health_seen and health_pb2.HealthCheckResponse.NOT_SERVING in health_seen
    assert health_seen.index(health_pb2.HealthCheckResponse.NOT_SERVING) < len(health_seen) - 1
    restarted = sup.client.model("alpha")
    assert restarted.pid != victim.pid and restarted.restarts == victim.restarts + 2
    assert generate(sup, model="alpha", prompt="x", max_tokens=5, ignore_eos=True)[1].stats.generated_tokens == 5
    assert sup.client.model("beta").restarts == 0


def test_a_request_right_after_a_runner_died_waits_for_its_restart(two_models):
    sup = two_models
    victim = sup.client.model("alpha")
    os.kill(victim.pid, signal.SIGKILL)
    time.sleep(0.05)  # before the supervisor can have restarted it
    text, last = generate(sup, model="alpha", prompt="x", max_tokens=5, ignore_eos=True)
    assert last.stats.generated_tokens == 5
    restarted = sup.client.model("alpha")
    assert restarted.pid != victim.pid and restarted.restarts == victim.restarts + 1


def test_sigterm_ends_a_stream_that_outlives_the_grace_with_a_clear_status(tmp_path):
    sup = SupervisorProcess(tmp_path, model_toml("only"), drain_grace="1s").wait_ready()
    call = sup.client.generate(timeout=120, model="only", prompt=PROMPT, max_tokens=6000, ignore_eos=True)
    next(call)
    sup.process.send_signal(signal.SIGTERM)
    with pytest.raises(grpc.RpcError) as caught:
        for _ in call:
            pass
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert caught.value.details().startswith("model only: supervisor shutting down"), caught.value.details()
    assert sup.process.wait(60) == 0


def test_memory_limits_release_and_restart(tmp_path):
    models = (
        model_toml("soft", soft_limit=1, prompt_cache="64MiB")  # always over: emptied and released, not restarted
        + model_toml("leaky", cache_limit="unbounded", release_enabled=False, hard_limit="300MiB")
    )
    sup = SupervisorProcess(tmp_path, models).wait_ready()
    try:
        # The supervisor logs its release after the runner has done it (and counted it): wait for both.
        assert wait_until(
            lambda: sup.client.model("soft").memory.mlx_releases >= 3 and "over the soft limit" in sup.stderr, 30
        )
        assert "ReleaseMemory" not in sup.stderr
        # A request leaves its KV cache in the prompt cache; the policy empties it first, then releases the pool.
        generate(sup, model="soft", prompt=PROMPT * 20, max_tokens=20, ignore_eos=True)
        assert wait_until(lambda: "evicted 1 prompt-cache entries" in sup.stderr, 15, interval=0.2), sup.stderr[-2000:]
        line = next(text for text in sup.stderr.splitlines() if "evicted 1 prompt-cache entries" in text)
        assert line.index("evicted 1 prompt-cache entries") < line.index("then released the pool")
        assert wait_until(lambda: sup.client.model("soft").memory.prompt_cache.entries == 0, 5)
        soft = sup.client.model("soft").memory
        assert soft.prompt_cache.evictions == 1 and soft.prompt_cache.budget == 64 * 2**20
        assert 'mlxserve_prompt_cache_evictions{model="soft"} 1.0' in sup.probe("/metrics")[1]
        assert sup.client.model("soft").restarts == 0
        before = sup.client.model("leaky")
        with pytest.raises(grpc.RpcError) as caught:
            generate(sup, model="leaky", prompt=PROMPT, max_tokens=6000, ignore_eos=True)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "hard limit of 300 MiB" in caught.value.details()
        assert sup.client.wait_serving(60, service="leaky")
        after = sup.client.model("leaky")
        assert after.restarts == before.restarts + 1 and after.pid != before.pid
        assert sup.probe("/metrics")[1].count('mlxserve_soft_limit_releases{model="soft"}') == 1
    finally:
        assert sup.stop() == 0


def test_sigterm_drains_and_leaves_no_child(tmp_path):
    sup = SupervisorProcess(tmp_path, model_toml("only")).wait_ready()
    pids = sup.runner_pids()
    assert len(pids) == 1
    call = sup.client.generate(timeout=60, model="only", prompt="x", max_tokens=150, ignore_eos=True)
    next(call)
    sup.process.send_signal(signal.SIGTERM)
    chunks = list(call)
    assert chunks[-1].stats.generated_tokens == 150  # drained, not cut off
    assert sup.process.wait(60) == 0
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert list(sup.runtime_dir.glob("*.sock")) == []


def test_supervisor_killed_takes_its_runners_and_restarts_cleanly(tmp_path):
    sup = SupervisorProcess(tmp_path, model_toml("only")).wait_ready()
    runners = [psutil.Process(p) for p in sup.runner_pids()]
    sup.process.kill()
    sup.process.wait()
    gone, alive = psutil.wait_procs(runners, timeout=10)
    assert not alive, "a runner outlived the supervisor"
    again = SupervisorProcess(tmp_path, model_toml("only")).wait_ready()  # same runtime_dir, stale socket
    try:
        assert generate(again, model="only", prompt="x", max_tokens=4, ignore_eos=True)[1].stats.generated_tokens == 4
    finally:
        assert again.stop() == 0


EOS_OFF = {"ignore_eos": True}


def give_up(sup, outcome: dict, **body) -> None:
    """An embedding request through OpenAI's SDK that gives up after 5 s: ``outcome["raised"]``, what it raised."""
    try:
        sup.openai().with_options(timeout=5).embeddings.create(**body)
    except Exception as raised:
        outcome["raised"] = type(raised).__name__


def give_up_loading(sup, outcome: dict, model: str) -> None:
    """Ollama's client asking to load ``model`` (an embed request with no input), giving up after 5 s."""
    try:
        sup.ollama(timeout=5).embed(model=model, input=[])
    except Exception as raised:
        outcome["raised"] = type(raised).__name__


def test_lru_eviction_and_keep_alive(tmp_path):
    models = model_toml("first") + model_toml("second", load_at_start=False, keep_alive="2s")
    models += model_toml("minilm", target=MINILM_DIR, draft=None, load_at_start=False)
    sup = SupervisorProcess(tmp_path, models, max_loaded=1).wait_ready()
    try:
        assert sup.client.model("second").state == supervisor_pb2.RUNNER_STATE_STOPPED
        # A request for "second" that its client gives up while it waits for "first"'s place stops the wait at
        # once: "first" takes new requests again (it did only at the request's deadline, 120 s here).
        busy = sup.client.generate(timeout=120, model="first", prompt="x", max_tokens=4000, ignore_eos=True)
        next(busy)
        given_up = sup.client.generate(timeout=120, model="second", prompt="x", max_tokens=4)
        assert wait_until(lambda: sup.client.model("first").making_room_for == "second", 60)
        given_up.cancel()
        assert wait_until(lambda: not sup.client.model("first").making_room_for, 10)
        assert generate(sup, model="first", prompt="x", max_tokens=3, ignore_eos=True)[1].stats.generated_tokens == 3
        assert wait_until(lambda: sup.client.model("first").in_flight == 1, 10)  # the long answer is still going
        # So does an embedding request's, whose gRPC call is cancelled (it has no generation's event: it waited on
        # to its deadline, and "first" took no new request meanwhile).
        embedding = sup.client.stub.Embed.future(
            supervisor_pb2.EmbedRequest(model="minilm", texts=["x"]), timeout=120, metadata=sup.client.metadata
        )
        assert wait_until(lambda: sup.client.model("first").making_room_for == "minilm", 60)
        embedding.cancel()
        assert wait_until(lambda: not sup.client.model("first").making_room_for, 10)
        assert generate(sup, model="first", prompt="x", max_tokens=3, ignore_eos=True)[1].stats.generated_tokens == 3
        assert sup.client.model("minilm").state == supervisor_pb2.RUNNER_STATE_STOPPED
        # And over HTTP: an OpenAI SDK client that gives up (its timeout closes the connection).
        outcome = {}
        gave_up = threading.Thread(target=give_up, args=(sup, outcome), kwargs={"model": "minilm", "input": "x"})
        gave_up.start()
        assert wait_until(lambda: sup.client.model("first").making_room_for == "minilm", 60)
        gave_up.join(30)
        assert outcome.get("raised") == "APITimeoutError"
        assert wait_until(lambda: not sup.client.model("first").making_room_for, 10)
        assert sup.client.model("minilm").state == supervisor_pb2.RUNNER_STATE_STOPPED
        # So does a request that only loads the model (Ollama's, with nothing to embed), whose client gives up.
        outcome = {}
        gave_up = threading.Thread(target=give_up_loading, args=(sup, outcome, "minilm"))
        gave_up.start()
        assert wait_until(lambda: sup.client.model("first").making_room_for == "minilm", 60)
        gave_up.join(30)
        assert outcome.get("raised") in ("ReadTimeout", "TimeoutException"), outcome
        assert wait_until(lambda: not sup.client.model("first").making_room_for, 10)
        assert sup.client.model("minilm").state == supervisor_pb2.RUNNER_STATE_STOPPED
        busy.cancel()
        assert sup.client.model("second").state == supervisor_pb2.RUNNER_STATE_STOPPED
        assert wait_until(lambda: sup.client.model("first").in_flight == 0, 10)
        # "first" loads at start (it may still be loading) and answers a long request: only a serving runner
        # with nothing in flight is evicted, so the request for "second" waits for that answer to end, then
        # loads "second" in its place (it was refused at once, "none is idle", before)
        answering, ended = threading.Event(), {}

        def long_answer() -> None:
            # Long enough to be under way when "second" is asked for (200 tokens took under a second once the next
            # first draft was queued with each verification, and could end before it: nothing to make room from).
            for chunk in sup.client.generate(timeout=120, model="first", prompt="x", max_tokens=1000, ignore_eos=True):
                answering.set()
            ended["first"], ended["tokens"] = time.monotonic(), chunk.stats.generated_tokens

        def second() -> None:
            # Loads on first request, evicting "first"; through OpenAI's SDK, which waits for the place as a gRPC
            # client does.
            answer = sup.openai().completions.create(model="second", prompt="x", max_tokens=4, extra_body=EOS_OFF)
            ended["second"], ended["second_tokens"] = time.monotonic(), answer.usage.completion_tokens

        threads = [threading.Thread(target=long_answer), threading.Thread(target=second)]
        threads[0].start()
        assert answering.wait(90)
        pid = sup.client.model("first").pid
        threads[1].start()
        # While "second" waits, "first" makes room for it: a new request for "first" waits its turn - "second"
        # answers, then "first" loads again in its place - where "first" served it at once, and a model kept
        # busy held its place until the waiting request's deadline.
        assert wait_until(lambda: sup.client.model("first").making_room_for == "second", 60)
        assert "making room for second" in format_models(sup.client.list_models().models)
        later_began = None
        for chunk in sup.client.generate(timeout=120, model="first", prompt="y", max_tokens=4, ignore_eos=True):
            later_began = later_began or time.monotonic()
        assert chunk.stats.generated_tokens == 4
        for thread in threads:
            thread.join(60)
        assert ended["tokens"] == 1000 and ended["first"] <= ended["second"]  # the long answer was whole, ended first
        assert ended["second"] <= later_began  # "second" answered before the later request for "first" began
        assert ended["second_tokens"] == 4
        first = sup.client.model("first")
        assert first.state == supervisor_pb2.RUNNER_STATE_SERVING and first.pid not in (0, pid)  # loaded again
        assert not first.making_room_for
        assert "evicted to load first" in sup.client.model("second").reason
        generate(sup, model="second", prompt="x", max_tokens=4)  # "first" is idle: evicted at once
        assert "evicted to load second" in sup.client.model("first").reason
        assert wait_until(lambda: sup.client.model("second").state == supervisor_pb2.RUNNER_STATE_STOPPED, 15)
        assert "keep_alive" in sup.client.model("second").reason
        loaded = sup.client.load_model("first")
        assert loaded.state == supervisor_pb2.RUNNER_STATE_SERVING
        unloaded = sup.client.unload_model("first")
        assert unloaded.state == supervisor_pb2.RUNNER_STATE_STOPPED
    finally:
        assert sup.stop() == 0


def test_runner_that_cannot_start_ends_failed_while_the_other_serves(tmp_path):
    import shutil

    from common.defaults import DEFAULT_TARGET

    broken = tmp_path / "broken-model"
    shutil.copytree(DEFAULT_TARGET, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    models = model_toml("good") + model_toml("bad", target=broken, draft=None)
    sup = SupervisorProcess(tmp_path / "sup", models, max_restarts=2)
    try:
        assert sup.client.wait_serving(60, service="good")  # overall health stays NOT_SERVING: "bad" never serves
        assert wait_until(lambda: sup.client.model("bad").state == supervisor_pb2.RUNNER_STATE_FAILED, 60, interval=0.2)
        bad = sup.client.model("bad")
        assert "gave up after 3 failures" in bad.reason and str(broken) in bad.reason
        with pytest.raises(grpc.RpcError) as caught:
            generate(sup, model="bad", prompt="x", max_tokens=3)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION and str(broken) in caught.value.details()
        assert generate(sup, model="good", prompt="x", max_tokens=3, ignore_eos=True)[1].stats.generated_tokens == 3
        assert sup.probe("/readyz")[0] == 503
    finally:
        assert sup.stop() == 0


def test_hung_runner_is_detected_killed_and_restarted(tmp_path):
    from common.client import RunnerClient
    from common.protocol import runner_pb2

    models = model_toml("stuck", debug_rpcs=True, stall_after=1.0) + model_toml("fine")
    sup = SupervisorProcess(
        tmp_path, models, health_period="0.3s", health_deadline="0.5s", health_misses=3
    ).wait_ready()
    try:
        before = sup.client.model("stuck")
        with RunnerClient(f"unix://{sup.runtime_dir}/stuck.sock") as runner:
            runner.stub.DebugBlock(runner_pb2.DebugBlockRequest(seconds=120), timeout=5)  # blocks its MLX thread
        assert wait_until(lambda: sup.client.model("stuck").pid not in (0, before.pid), 30, interval=0.1)
        assert sup.client.wait_serving(60, service="stuck")
        after = sup.client.model("stuck")
        assert after.restarts == before.restarts + 1
        assert "hung" in sup.stderr and "missed 3 health checks" in sup.stderr
        assert generate(sup, model="stuck", prompt="x", max_tokens=3, ignore_eos=True)[1].stats.generated_tokens == 3
        assert sup.client.model("fine").restarts == 0
    finally:
        assert sup.stop() == 0


def test_client_cli(two_models):
    import subprocess
    import sys

    from tests.processes import child_environment

    address = f"127.0.0.1:{two_models.port}"

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "supervisor", *args, "--address", address],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_environment(),
        )

    expected, _ = generate(two_models, model="beta", prompt=PROMPT, max_tokens=30)
    done = cli("generate", "--model", "beta", "--max-tokens", "30", PROMPT)
    assert done.returncode == 0 and done.stdout.rstrip("\n") == expected.rstrip("\n")
    assert "30 tokens" in done.stderr
    models = cli("models")
    assert models.returncode == 0 and "alpha" in models.stdout and "serving" in models.stdout
    assert "MLX active" in cli("memory").stdout and "ready" in cli("status").stdout
    missing = cli("generate", "--model", "nope", "x")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
