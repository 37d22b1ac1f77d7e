"""Reliability and security: faults, bad input and load, caused for real against the real system.

Every test here is a case of docs/reliability.md (python -m tests.reliability_report writes it from
a run of this module); its docstring's first line is the case, ``record_property`` adds the figures.
"""

import concurrent.futures
import math
import os
import signal
import subprocess
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.defaults import DEFAULT_TARGET
from common.protocol import runner_pb2
from supervisor.client import SupervisorClient
from supervisor.protocol import supervisor_pb2
from tests.processes import (
    SupervisorProcess,
    model_toml,
    resumed_on_a_new_runner,
    serve_expecting_refusal,
    wait_until,
)

PROMPT = "The for statement is used to iterate over the elements of a sequence"
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    sup = SupervisorProcess(tmp_path_factory.mktemp("rel"), model_toml("one") + model_toml("two"))
    sup.wait_ready()
    yield sup
    assert sup.stop() == 0


def outcome(call_fn) -> tuple[grpc.StatusCode, list]:
    try:
        return grpc.StatusCode.OK, list(call_fn())
    except grpc.RpcError as error:
        return error.code(), []


# -- bad input ---------------------------------------------------------------------------------

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
int32 = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=text,
    max_tokens=st.one_of(st.integers(-5, 12), int32),
    temperature=floats,
    top_k=int32,
    top_p=st.one_of(st.none(), floats),
    min_p=floats,
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    stop=st.lists(text, max_size=80),
    k=st.one_of(st.none(), int32),
    model=st.sampled_from(["one", "two", "", "x\x00"]),
    prompt_ids=st.lists(int32, max_size=20),
)
def test_fuzzed_generate_requests_get_ok_or_a_documented_error(
    pair, prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop, k, model, prompt_ids
):
    """Fuzzed public Generate requests: OK or a documented code, never INTERNAL, no runner crash."""
    fields = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        min_p=min_p,
        stop=stop,
        prompt_ids=prompt_ids,
    )
    if top_p is not None:
        fields["top_p"] = top_p
    if seed is not None:
        fields["seed"] = seed
    if k is not None:
        fields["num_draft_tokens"] = k
    code, _ = outcome(lambda: pair.client.generate(timeout=3, **fields))
    assert code in DOCUMENTED, code


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=200),
    stop=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6), max_size=5),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.05, 1),
    top_k=st.integers(0, 100),
    min_p=st.floats(0, 0.5),
    seed=st.integers(0, 2**32),
    k=st.integers(0, 6),
    max_tokens=st.integers(1, 16),
)
def test_fuzzed_valid_requests_generate_within_their_limits(
    pair, prompt, stop, temperature, top_p, top_k, min_p, seed, k, max_tokens
):
    """Fuzzed valid requests (any unicode prompt and stop strings): OK, within max_tokens, no stop string in the
    text."""
    code, chunks = outcome(
        lambda: pair.client.generate(
            timeout=60,
            model="one",
            prompt=prompt,
            stop=stop,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            num_draft_tokens=k,
            max_tokens=max_tokens,
        )
    )
    assert code == grpc.StatusCode.OK
    text = "".join(c.text for c in chunks)
    stats = chunks[-1].stats
    assert stats.generated_tokens == sum(len(c.token_ids) for c in chunks) <= max_tokens
    assert not any(s in text for s in stop)


def test_fuzzing_left_every_runner_unharmed(pair, record_property):
    """After fuzzing: no runner restarted, both still serve."""
    models = pair.client.list_models().models
    record_property("restarts", sum(m.restarts for m in models))
    assert all(m.restarts == 0 and m.state == supervisor_pb2.RUNNER_STATE_SERVING for m in models)


@pytest.mark.parametrize(
    "case, fields",
    [
        ("prompt over the context length", dict(prompt_ids=[5] * 9000, max_tokens=4)),
        ("thousands of stop strings", dict(prompt="x", max_tokens=4, stop=["s"] * 5000)),
        ("NaN temperature", dict(prompt="x", max_tokens=4, temperature=math.nan)),
        ("infinite top_p", dict(prompt="x", max_tokens=4, top_p=math.inf)),
    ],
)
def test_named_bad_requests_are_invalid_argument(pair, case, fields):
    """Prompt over the context, thousands of stop strings, NaN/inf numbers: INVALID_ARGUMENT."""
    code, _ = outcome(lambda: pair.client.generate(timeout=10, model="one", **fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_oversized_message_is_resource_exhausted(pair):
    """A request over the 8 MiB message limit: RESOURCE_EXHAUSTED, nothing else breaks."""
    code, _ = outcome(lambda: pair.client.generate(timeout=10, model="one", prompt="z" * (9 * 2**20), max_tokens=1))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        outcome(lambda: pair.client.generate(timeout=30, model="one", prompt="x", max_tokens=2))[0]
        == grpc.StatusCode.OK
    )


# -- load -----------------------------------------------------------------------------------------


def test_32_concurrent_clients_over_2_models(pair, record_property):
    """32 concurrent streaming clients for a bounded time: every request completes (batched), none hangs."""
    idle = {m.name: m.memory.rss for m in pair.client.get_memory().models}
    results: list[tuple[grpc.StatusCode, int, float]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + 20

    def client(i):
        model = ("one", "two")[i % 2]
        with SupervisorClient(f"127.0.0.1:{pair.port}") as c:
            while time.monotonic() < stop_at:
                started = time.monotonic()
                code, chunks = outcome(
                    lambda: c.generate(timeout=30, model=model, prompt=f"{PROMPT} {i}", max_tokens=24, ignore_eos=True)
                )
                elapsed = time.monotonic() - started
                if code == grpc.StatusCode.OK:
                    assert sum(len(ch.token_ids) for ch in chunks) == chunks[-1].stats.generated_tokens == 24
                with lock:
                    results.append((code, len(chunks), elapsed))
                if code != grpc.StatusCode.OK:
                    time.sleep(0.05)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a client hung"
    codes = [r[0] for r in results]
    ok, busy = codes.count(grpc.StatusCode.OK), codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    record_property("requests", len(codes))
    record_property("completed", ok)
    record_property("resource_exhausted", busy)
    record_property("slowest_s", round(max(r[2] for r in results), 2))
    assert ok == len(codes) and busy == 0, set(codes)  # 16 clients a model fit its batch: nobody is refused
    assert max(r[2] for r in results) < 30

    # Memory goes back to its idle level once the load is gone (the pool is released per request), but for
    # what the prompt cache now holds.
    def settled():
        models = pair.client.get_memory().models
        record_property("rss_after_mib", {m.name: round(m.memory.rss / 2**20) for m in models})
        record_property("prompt_cache_mib", {m.name: round(m.memory.prompt_cache.bytes / 2**20) for m in models})
        return all(
            m.memory.rss - m.memory.prompt_cache.bytes < idle[m.name] + 64 * 2**20 and m.in_flight == 0 for m in models
        )

    assert wait_until(settled, 20, interval=0.3), pair.client.get_memory()


# -- faults -------------------------------------------------------------------------------------


def test_runner_killed_during_prefill(pair):
    """Runner SIGKILLed during a long prefill (nothing streamed yet): the request waits for the restart and is
    answered."""
    victim = pair.client.model("two")
    call = pair.client.generate(
        timeout=120, model="two", prompt_ids=[7 + (i % 3000) for i in range(3000)], max_tokens=5, ignore_eos=True
    )
    assert wait_until(lambda: pair.client.model("two").in_flight == 1, 10)
    time.sleep(0.3)  # inside the 3000-token prefill, which takes seconds
    os.kill(victim.pid, signal.SIGKILL)
    code, chunks = outcome(lambda: call)
    assert code == grpc.StatusCode.OK and chunks[-1].stats.generated_tokens == 5
    restarted = pair.client.model("two")
    assert restarted.restarts == victim.restarts + 1 and restarted.pid != victim.pid
    assert "sending the request again" in pair.stderr
    assert (
        outcome(lambda: pair.client.generate(timeout=30, model="two", prompt="x", max_tokens=3))[0]
        == grpc.StatusCode.OK
    )
    assert pair.client.model("one").restarts == 0  # the other model never noticed


def test_a_runner_that_dies_mid_stream_is_resumed_and_the_answer_is_the_uninterrupted_one(pair):
    """Runner dies of SIGSEGV mid-stream: the supervisor resumes the answer on the restarted runner (the prompt
    plus the tokens sent), so the client sees a pause, and greedy output equals an uninterrupted run; usage
    counts the one answer. A second death of the same request ends it with the cause."""
    whole = list(pair.client.generate(timeout=120, model="one", prompt=PROMPT, max_tokens=300, ignore_eos=True))
    victim = pair.client.model("one")
    call = pair.client.generate(timeout=120, model="one", prompt=PROMPT, max_tokens=300, ignore_eos=True)
    chunks = [next(call)]
    os.kill(victim.pid, signal.SIGSEGV)
    code, rest = outcome(lambda: call)
    chunks += rest
    assert code == grpc.StatusCode.OK
    assert [t for c in chunks for t in c.token_ids] == [t for c in whole for t in c.token_ids]
    assert "".join(c.text for c in chunks) == "".join(c.text for c in whole)
    assert chunks[-1].stats.generated_tokens == 300 and chunks[-1].stats.prompt_tokens == whole[-1].stats.prompt_tokens
    assert "resuming the answer" in pair.stderr and "SIGSEGV" in pair.stderr
    assert pair.client.model("one").restarts == victim.restarts + 1
    # Killed twice: the second time the client is told, naming the model and the signal.
    call = pair.client.generate(timeout=120, model="one", prompt=PROMPT, max_tokens=4000, ignore_eos=True)
    next(call)
    first = pair.client.model("one").pid
    os.kill(first, signal.SIGKILL)
    os.kill(resumed_on_a_new_runner(pair, "one", first), signal.SIGSEGV)
    code, _ = outcome(lambda: call)
    assert code == grpc.StatusCode.UNAVAILABLE and "SIGSEGV" in call.details() and "one" in call.details()
    assert pair.client.wait_serving(60, service="one")


def test_a_runner_killed_under_16_clients_loses_no_request(pair, record_property):
    """Runner SIGKILLed while 16 clients stream: every accepted request completes (resumed on the restarted
    runner), each with all its tokens, greedy text equal to its uninterrupted run."""
    prompts = [f"{PROMPT} number {i}" for i in range(16)]
    alone = {
        p: list(pair.client.generate(timeout=120, model="two", prompt=p, max_tokens=120, ignore_eos=True))
        for p in prompts[:2]
    }
    victim = pair.client.model("two")
    calls = [pair.client.generate(timeout=300, model="two", prompt=p, max_tokens=120, ignore_eos=True) for p in prompts]
    firsts = [next(call) for call in calls]  # every one under way
    os.kill(victim.pid, signal.SIGKILL)
    results = []
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda call: outcome(lambda: call), calls))
    codes = [code for code, _ in results]
    record_property("completed", f"{codes.count(grpc.StatusCode.OK)} of {len(codes)}")
    assert codes == [grpc.StatusCode.OK] * 16
    for first, (_, rest), prompt in zip(firsts, results, prompts):
        chunks = [first, *rest]
        assert chunks[-1].stats.generated_tokens == 120 and sum(len(c.token_ids) for c in chunks) == 120
        if prompt in alone:
            assert "".join(c.text for c in chunks) == "".join(c.text for c in alone[prompt])
    assert pair.client.model("two").restarts == victim.restarts + 1


def test_runner_killed_before_ready(tmp_path):
    """Runner killed while loading: restarted, and the waiting request is then served."""
    sup = SupervisorProcess(tmp_path, model_toml("late", load_at_start=False))
    try:
        assert wait_until(lambda: sup.client.health_status() is not None, 60)
        request = dict(model="late", prompt="x", max_tokens=3, ignore_eos=True)
        result = {}
        # The request starts the model (not loaded at start): it waits before the runner even exists.
        t = threading.Thread(
            target=lambda: result.update(r=outcome(lambda: sup.client.generate(timeout=120, **request)))
        )
        t.start()
        assert wait_until(lambda: sup.client.model("late").pid != 0, 30, interval=0.005)
        first = sup.client.model("late")
        # Frozen, the runner can neither come up nor stream; still STARTING once frozen, it never has: the kill
        # lands while it loads, before the request reached it.
        os.kill(first.pid, signal.SIGSTOP)
        assert sup.client.model("late").state == supervisor_pb2.RUNNER_STATE_STARTING
        os.kill(first.pid, signal.SIGKILL)
        t.join(120)
        assert not t.is_alive(), "the waiting request hung"
        # It waited through the restart (STARTING, BACKOFF, STARTING: Scheduler.acquire) and was answered.
        code, chunks = result["r"]
        assert code == grpc.StatusCode.OK, code
        assert chunks[-1].stats.generated_tokens == 3 and chunks[-1].finish_reason == runner_pb2.FINISH_REASON_LENGTH
        restarted = sup.client.model("late")
        assert restarted.restarts == 1 and restarted.pid not in (0, first.pid)
        assert restarted.state == supervisor_pb2.RUNNER_STATE_SERVING
        code, again = outcome(lambda: sup.client.generate(timeout=30, **request))
        assert code == grpc.StatusCode.OK
        assert "".join(c.text for c in again) == "".join(c.text for c in chunks)  # greedy: the same answer
    finally:
        assert sup.stop() == 0


def test_socket_file_deleted_under_a_runner(pair):
    """A runner's socket file deleted: the live connection keeps serving, no restart storm."""
    before = pair.client.model("one")
    socket = pair.runtime_dir / "one.sock"
    socket.unlink()
    time.sleep(2.0)  # several health periods
    after = pair.client.model("one")
    assert after.restarts == before.restarts and after.state == supervisor_pb2.RUNNER_STATE_SERVING
    assert (
        outcome(lambda: pair.client.generate(timeout=30, model="one", prompt="x", max_tokens=3))[0]
        == grpc.StatusCode.OK
    )


# -- long generation memory -----------------------------------------------------------------------


def rss_during_long_generation(tmp_path, release: bool) -> tuple[int, int, list]:
    name = "fixed" if release else "leaky"
    sup = SupervisorProcess(tmp_path / name, model_toml(name, cache_limit="unbounded", release_enabled=release))
    try:
        sup.wait_ready()
        assert wait_until(lambda: sup.client.model(name).memory.history_samples >= 3, 10)
        idle = sup.client.model(name).memory.rss
        curve, done = [], threading.Event()

        def sample():
            while not done.is_set():
                curve.append(sup.client.model(name).memory.rss)
                time.sleep(0.3)

        sampler = threading.Thread(target=sample)
        sampler.start()
        chunks = list(sup.client.generate(timeout=300, model=name, prompt=PROMPT, max_tokens=4200, ignore_eos=True))
        done.set()
        sampler.join()
        assert chunks[-1].stats.generated_tokens == 4200
        return idle, max(curve), curve
    finally:
        assert sup.stop() == 0


def test_long_generation_rss_stays_under_the_bound_and_the_leak_crosses_it(tmp_path, record_property):
    """4200 speculative tokens, pool cap unbounded: RSS bounded with the release, over the bound without."""
    kv_per_token = 8 * 2 * 2 * 64 * 4 + 2 * 2 * 2 * 32 * 4  # target + draft layers x (k, v) x heads x dim x fp32
    cache = kv_per_token * 4608  # 4200 + prompt, rounded up to the 256 step
    # Both at once, one runner each (each figure is its own process's RSS): half the wall time.
    measured = {}
    threads = [
        threading.Thread(target=lambda r=r: measured.__setitem__(r, rss_during_long_generation(tmp_path, r)))
        for r in (True, False)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    idle, fixed_peak, fixed_curve = measured[True]
    # idle (weights + runtime) + the cache + one growth step's freed buffer + round transients (see the engine test)
    bound = idle + 4 * cache + 32 * 2**20
    leaky_idle, leaky_peak, leaky_curve = measured[False]

    def mib(xs):
        return [round(x / 2**20) for x in xs[:: max(1, len(xs) // 12)]]

    record_property("bound_mib", round(bound / 2**20))
    record_property("rss_with_release_mib", mib(fixed_curve))
    record_property("rss_without_release_mib", mib(leaky_curve))
    assert fixed_peak < bound, (fixed_peak, bound)
    assert leaky_peak > leaky_idle - idle + bound, (leaky_peak, bound)


# -- security -------------------------------------------------------------------------------------


def test_no_prompt_or_output_in_logs_or_probes(pair):
    """Prompts and outputs never reach the logs or the probe port."""
    secret = "Zebra-Quokka-Unique-Prompt"
    chunks = list(pair.client.generate(timeout=60, model="one", prompt=secret, max_tokens=40, ignore_eos=True))
    output = "".join(c.text for c in chunks)
    time.sleep(0.5)
    logs = pair.stderr
    assert secret not in logs and (len(output.strip()) < 12 or output.strip()[:30] not in logs)
    assert secret not in pair.probe("/metrics")[1]


def test_bearer_token_is_required_when_configured(tmp_path):
    """With auth_token set, every RPC without the right bearer token is UNAUTHENTICATED."""
    sup = SupervisorProcess(tmp_path, model_toml("m"), auth_token="s3cret").wait_ready()
    try:
        for token in ("", "wrong"):
            with SupervisorClient(f"127.0.0.1:{sup.port}", token=token) as c:
                assert (
                    outcome(lambda: c.generate(timeout=10, model="m", prompt="x", max_tokens=2))[0]
                    == grpc.StatusCode.UNAUTHENTICATED
                )
                with pytest.raises(grpc.RpcError) as caught:
                    c.list_models()
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with SupervisorClient(f"127.0.0.1:{sup.port}", token="s3cret") as c:
            assert outcome(lambda: c.generate(timeout=30, model="m", prompt="x", max_tokens=2))[0] == grpc.StatusCode.OK
    finally:
        assert sup.stop() == 0


def test_tls_can_be_configured(tmp_path):
    """With tls_cert/tls_key the API speaks TLS only."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    sup = SupervisorProcess(tmp_path, model_toml("m"), tls_cert=str(cert), tls_key=str(key))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        channel = grpc.secure_channel(f"127.0.0.1:{sup.port}", credentials)
        from supervisor.protocol import supervisor_pb2_grpc

        stub = supervisor_pb2_grpc.SupervisorStub(channel)
        assert wait_until(
            lambda: (
                outcome(lambda: [stub.GetStatus(supervisor_pb2.GetStatusRequest(), timeout=2)])[0] == grpc.StatusCode.OK
            ),
            60,
            interval=0.2,
        )
        plain = SupervisorClient(f"127.0.0.1:{sup.port}")
        assert plain.health_status(timeout=2) is None  # plaintext is refused
        channel.close()
    finally:
        sup.stop()


def test_remote_bind_needs_an_explicit_setting(tmp_path):
    """Binding a non-loopback address without allow_remote stops start-up."""
    path = tmp_path / "c.toml"
    path.write_text(f'listen = "0.0.0.0:0"\n[models.m]\ntarget = "{DEFAULT_TARGET}"\n')
    done = serve_expecting_refusal(path)
    assert done.returncode == 2 and "allow_remote" in done.stderr


def test_client_gone_mid_stream_frees_the_runner(pair):
    """A client that cancels or whose deadline passes: its runner is free again within a round."""
    call = pair.client.generate(timeout=120, model="one", prompt=PROMPT, max_tokens=6000, ignore_eos=True)
    next(call)
    call.cancel()
    assert wait_until(lambda: pair.client.model("one").in_flight == 0, 5)
    code, _ = outcome(
        lambda: pair.client.generate(timeout=1.0, model="one", prompt=PROMPT, max_tokens=6000, ignore_eos=True)
    )
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    # Were either 6000-token generation still running (25 s and more), this would queue behind it and time out.
    assert (
        outcome(lambda: pair.client.generate(timeout=10, model="one", prompt="x", max_tokens=3))[0]
        == grpc.StatusCode.OK
    )


def test_public_port_already_in_use(tmp_path):
    """The public port already taken: start-up stops with a clear message, no runner started."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = tmp_path / "c.toml"
        path.write_text(
            f'listen = "127.0.0.1:{port}"\nprobe_port = 0\nruntime_dir = "{tmp_path}/run"\n'
            f'[models.m]\ntarget = "{DEFAULT_TARGET}"\n'
        )
        done = serve_expecting_refusal(path)
    assert done.returncode == 2 and f"127.0.0.1:{port}" in done.stderr
    assert "runner[" not in done.stderr


def test_runner_exit_code_1_mid_stream(tmp_path):
    """Runner exits with code 1 mid-stream (a debug RPC stands in for a fatal error): the answer is resumed
    on the restarted runner; when that one exits too, the client is told."""
    from common.client import RunnerClient
    from common.protocol import runner_pb2

    sup = SupervisorProcess(tmp_path, model_toml("frail", debug_rpcs=True)).wait_ready()
    try:
        call = sup.client.generate(timeout=120, model="frail", prompt=PROMPT, max_tokens=4000, ignore_eos=True)
        next(call)
        for death in range(2):
            pid = sup.client.model("frail").pid
            with RunnerClient(f"unix://{sup.runtime_dir}/frail.sock") as runner:
                runner.stub.DebugExit(runner_pb2.DebugExitRequest(code=1), timeout=5)
            if death == 0:
                resumed_on_a_new_runner(sup, "frail", pid)
        code, _ = outcome(lambda: call)
        assert code == grpc.StatusCode.UNAVAILABLE and "exited with code 1" in call.details()
        assert "resuming the answer" in sup.stderr
        assert sup.client.wait_serving(60, service="frail")
        assert sup.client.model("frail").restarts == 2
    finally:
        assert sup.stop() == 0
