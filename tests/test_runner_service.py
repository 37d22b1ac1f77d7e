"""A real runner process on the default pair, driven over real gRPC."""

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from common.client import RunnerClient
from common.protocol import runner_pb2
from runner.engine import GenerationRequest
from tests.helpers import collect
from tests.processes import RunnerProcess, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "The for statement is used to iterate over the elements of a sequence"


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    process = RunnerProcess(
        tmp_path_factory.mktemp("run") / "sockets",
        "--max-queue",
        "2",
        "--max-batch",
        "2",
        "--batch-memory",
        str(256 * 2**20),
    )  # room for both rows of every test here
    seen = []
    deadline = time.monotonic() + 60
    # The server listens before the models load. Wait for its socket file, then ask on fresh
    # channels: a channel that failed while the runner was importing would sit in reconnect
    # backoff and could miss the short loading window.
    assert wait_until(lambda: process.socket.exists() or not process.alive(), 60, interval=0.002)
    while time.monotonic() < deadline and process.alive():
        with RunnerClient(process.address) as fresh:
            status = fresh.health_status(timeout=0.5)
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        if status == SERVING:
            break
        time.sleep(0.005)
    process.health_history = seen
    yield process
    assert process.stop() == 0


def stream(runner, **fields):
    chunks = list(runner.client.generate(timeout=120, **fields))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks


def test_health_goes_from_not_serving_to_serving(runner):
    assert runner.health_history == [NOT_SERVING, SERVING]


def test_streamed_generation_matches_the_engine_in_process(runner, engine):
    tokens, text, chunks = stream(runner, prompt=PROMPT, max_tokens=300, num_draft_tokens=3, ignore_eos=True)
    local_tokens, local_text, _ = collect(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=300, num_draft_tokens=3, ignore_eos=True))
    )
    assert tokens == local_tokens and text == local_text
    last = chunks[-1]
    assert last.finish_reason == runner_pb2.FINISH_REASON_LENGTH
    assert all(c.finish_reason == runner_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    stats = last.stats
    assert stats.generated_tokens == len(tokens) == 300
    assert stats.rounds == len(chunks)
    assert stats.drafted == sum(c.drafted for c in chunks) and stats.accepted == sum(c.accepted for c in chunks)
    assert len(stats.release_positions) == 1 and 256 <= stats.release_positions[0] <= 259
    assert stats.releases == 2


def test_prompt_ids_and_sampling_fields_travel(runner, engine):
    ids = engine.tokenizer.encode(PROMPT)
    fields = dict(
        prompt_ids=ids, max_tokens=40, temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=7, ignore_eos=True
    )
    first, _, _ = stream(runner, **fields)
    again, _, _ = stream(runner, **fields)
    local, _, _ = collect(engine.generate(GenerationRequest(**{**fields, "prompt_ids": tuple(ids)})))
    assert first == again == local


def test_info_describes_the_pair(runner):
    info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
    assert info.target.architecture == "llama" and info.draft.architecture == "llama"
    assert 13e6 < info.target.parameters < 15e6 and 0.5e6 < info.draft.parameters < 1.5e6
    assert info.target.context_length >= 8192 and info.release_interval == 256
    assert info.pid == runner.process.pid and info.device == "cpu" and info.num_draft_tokens > 0
    assert info.backend == "cpu" and info.device_detail.startswith("the CPU (")
    assert info.max_batch == 2 and info.batch_memory == 256 * 2**20


@pytest.mark.parametrize(
    "fields, field_name",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="x", prompt_ids=[1, 2]), "prompt"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", max_tokens=5, temperature=-1), "temperature"),
        (dict(prompt="x", max_tokens=5, temperature=float("nan")), "temperature"),
        (dict(prompt="x", max_tokens=5, top_p=0.0), "top_p"),
        (dict(prompt="x", max_tokens=5, top_p=2.0), "top_p"),
        (dict(prompt="x", max_tokens=5, top_k=-3), "top_k"),
        (dict(prompt="x", max_tokens=5, min_p=-0.5), "min_p"),
        (dict(prompt="x", max_tokens=5, num_draft_tokens=-1), "num_draft_tokens"),
        (dict(prompt="x", max_tokens=5, num_draft_tokens=1000), "num_draft_tokens"),
        (dict(prompt_ids=[1, -4], max_tokens=5), "prompt_ids"),
        (dict(prompt_ids=[7] * 9000, max_tokens=5), "prompt"),
        (dict(prompt="x", max_tokens=5, stop=["s"] * 500), "stop"),
    ],
)
def test_bad_fields_are_invalid_argument_and_the_runner_keeps_serving(runner, fields, field_name):
    with pytest.raises(grpc.RpcError) as caught:
        stream(runner, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field_name)
    tokens, _, _ = stream(runner, prompt="x", max_tokens=3, ignore_eos=True)
    assert len(tokens) == 3


def test_oversized_message_is_refused_by_the_transport(runner):
    with pytest.raises(grpc.RpcError) as caught:
        stream(runner, prompt="y" * (9 * 2**20), max_tokens=1)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert runner.client.health_status() == SERVING


def long_request(runner, results, key, tokens=4000, **extra):
    def run():
        try:
            results[key] = stream(runner, prompt=PROMPT, max_tokens=tokens, ignore_eos=True, **extra)
        except grpc.RpcError as error:
            results[key] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def memory(runner):
    return runner.client.stub.Memory(runner_pb2.MemoryRequest(), timeout=1.0)


def test_a_full_batch_queues_and_overflow_is_resource_exhausted(runner):
    results = {}
    running = [long_request(runner, results, f"running{i}", tokens=1500) for i in range(2)]  # max_batch 2
    assert wait_until(lambda: memory(runner).active_requests == 2, 10)
    waiting = [long_request(runner, results, f"queued{i}", tokens=20) for i in range(2)]  # max_queue 2
    assert wait_until(lambda: memory(runner).queued == 2, 10)
    with pytest.raises(grpc.RpcError) as caught:
        stream(runner, prompt="x", max_tokens=3)
    assert (
        caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        and "2 requests already waiting" in caught.value.details()
    )
    for thread in (*running, *waiting):
        thread.join(120)
    assert all(results[f"running{i}"][2][-1].stats.generated_tokens == 1500 for i in range(2))
    assert all(results[f"queued{i}"][2][-1].stats.generated_tokens == 20 for i in range(2))


def test_health_and_memory_answer_during_a_long_generation(runner):
    results = {}
    thread = long_request(runner, results, "long", tokens=1500)
    assert wait_until(lambda: memory(runner).busy, 10)
    answered = 0
    while thread.is_alive() and answered < 20:
        m = memory(runner)  # each call has a 1 s deadline: a blocked runner would fail here
        if m.busy:
            assert m.rss > m.active > 0
            assert runner.client.health_status(timeout=1.0) == SERVING
            answered += 1
        time.sleep(0.05)
    assert answered == 20
    release = runner.client.stub.ReleaseMemory(runner_pb2.ReleaseMemoryRequest(), timeout=5)
    assert release.cache_after <= release.cache_before
    thread.join(120)
    assert results["long"][2][-1].stats.generated_tokens == 1500  # the release did not disturb it


def test_cancelled_stream_frees_the_runner_for_the_next_request(runner):
    call = runner.client.generate(timeout=120, prompt=PROMPT, max_tokens=6000, ignore_eos=True)
    for n, _ in enumerate(call):
        if n == 3:
            break
    call.cancel()
    assert wait_until(lambda: not memory(runner).busy, 5)
    tokens, _, _ = stream(runner, prompt="x", max_tokens=10, ignore_eos=True)
    assert len(tokens) == 10


def test_deadline_stops_the_generation(runner):
    with pytest.raises(grpc.RpcError) as caught:
        for _ in runner.client.generate(timeout=1.0, prompt=PROMPT, max_tokens=6000, ignore_eos=True):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: not memory(runner).busy, 5)


def test_debug_rpcs_are_off_by_default(runner):
    with pytest.raises(grpc.RpcError) as caught:
        runner.client.stub.DebugBlock(runner_pb2.DebugBlockRequest(seconds=5), timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as caught:
        runner.client.stub.DebugExit(runner_pb2.DebugExitRequest(code=1), timeout=5)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert runner.alive()
