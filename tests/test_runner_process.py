"""The runner as a process: signals, a dying parent, bad model folders, its socket, its stubs."""

import os
import shutil
import signal
import stat
import subprocess
import sys

import psutil

from common.defaults import DEFAULT_TARGET
from tests.helpers import draft_with_swapped_vocabulary
from tests.processes import REPO, RunnerProcess, child_environment


def test_sigterm_drains_and_exits_zero(tmp_path):
    runner = RunnerProcess(tmp_path / "sockets").wait_serving()
    assert stat.S_IMODE(os.stat(runner.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(runner.socket.parent).st_mode) == 0o700
    call = runner.client.generate(timeout=60, prompt="x", max_tokens=200, ignore_eos=True)
    next(call)
    runner.process.send_signal(signal.SIGTERM)
    chunks = list(call)  # in-flight work finishes inside the grace period
    assert chunks[-1].stats.generated_tokens == 200
    assert runner.process.wait(30) == 0
    assert not runner.socket.exists()
    assert "stopped" in runner.stderr


def test_stale_socket_file_is_replaced(tmp_path):
    first = RunnerProcess(tmp_path / "sockets").wait_serving()
    first.process.kill()  # leaves its socket file behind
    first.process.wait()
    assert first.socket.exists()
    second = RunnerProcess(tmp_path / "sockets").wait_serving()
    assert len(list(second.client.generate(timeout=30, prompt="x", max_tokens=3, ignore_eos=True))) >= 1
    assert second.stop() == 0


INTERMEDIATE = """
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
time.sleep(600)
"""


def test_runner_exits_when_its_parent_is_killed(tmp_path):
    sockets = tmp_path / "sockets"
    args = [sys.executable, "-m", "runner", "--target", str(DEFAULT_TARGET), "--listen", f"unix://{sockets}/r.sock"]
    parent = subprocess.Popen(
        [sys.executable, "-c", INTERMEDIATE, *args], stdout=subprocess.PIPE, env=child_environment(), text=True
    )
    runner_pid = int(parent.stdout.readline())
    from common.client import RunnerClient

    assert RunnerClient(f"unix://{sockets}/r.sock").wait_serving(60)
    runner = psutil.Process(runner_pid)
    parent.kill()
    parent.wait()
    gone, _ = psutil.wait_procs([runner], timeout=10)
    assert gone, "runner outlived its parent"


def start_and_fail(tmp_path, target, draft=None) -> tuple[int, str]:
    args = [sys.executable, "-m", "runner", "--target", str(target), "--listen", f"unix://{tmp_path}/s/r.sock"]
    if draft:
        args += ["--draft", str(draft)]
    done = subprocess.run(args, capture_output=True, text=True, env=child_environment(), timeout=120)
    return done.returncode, done.stderr


def test_missing_model_folder_exits_non_zero_naming_it(tmp_path):
    code, stderr = start_and_fail(tmp_path, tmp_path / "no-such-model")
    assert code == 2
    assert f"cannot load model from {tmp_path / 'no-such-model'}: no such folder" in stderr


def test_corrupt_safetensors_exits_non_zero(tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(DEFAULT_TARGET, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 1000)
    code, stderr = start_and_fail(tmp_path, broken)
    assert code == 2
    line = [text for text in stderr.splitlines() if text.startswith("runner: cannot load model")]
    assert len(line) == 1 and str(broken) in line[0]


def test_draft_with_another_tokenizer_exits_non_zero(tmp_path):
    other = draft_with_swapped_vocabulary(tmp_path / "other-draft")
    code, stderr = start_and_fail(tmp_path, DEFAULT_TARGET, other)
    assert code == 2 and "tokenizer differs" in stderr and str(other) in stderr


def test_tcp_port_already_in_use_exits_non_zero(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [sys.executable, "-m", "runner", "--target", str(DEFAULT_TARGET), "--listen", f"127.0.0.1:{port}"]
        done = subprocess.run(args, capture_output=True, text=True, env=child_environment(), timeout=60)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_generated_stubs_match_the_proto(tmp_path):
    import runpy

    generate = runpy.run_path(str(REPO / "proto" / "generate.py"))["generate"]
    written = generate(tmp_path)
    # Every stub of both protos, or a proto that went missing (or a generator that skips it) would pass unseen.
    assert sorted(str(p.relative_to(tmp_path)) for p in written) == [
        f"{package}/{stem}{suffix}"
        for package, stem in (("common/protocol", "runner"), ("supervisor/protocol", "supervisor"))
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    ]
    for fresh in written:
        committed = REPO / fresh.relative_to(tmp_path)
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run make proto"
