"""The device and backend a runner reports, and the memory policy's view of a CUDA GPU.

No GPU here: the CUDA cases run the policy's own functions with a GPU's figures, and ``nvidia-smi`` is a
stand-in script on PATH (a GPU cannot be made to exist on this machine). bench/device.sh is what checks the
real thing on a GPU; its CPU run (``--quick``) is tested below on parts that take seconds.
"""

from __future__ import annotations

import subprocess
import sys

import psutil

from common.footprint import expected_backend, expected_device
from supervisor.memory import MlxFigures, Sample, cuda_free_memory, free_memory, measured_memory
from tests.processes import REPO, child_environment

MIB = 2**20


def test_on_cuda_the_limits_count_what_mlx_holds_on_the_gpu():
    sample = Sample(at=0.0, rss=900 * MIB, anonymous=700 * MIB)
    mlx = MlxFigures(active=5000 * MIB, cache=1000 * MIB)
    assert measured_memory(sample, mlx, "cuda") == 6700 * MIB  # RSS does not see device memory
    assert measured_memory(sample, mlx, "cpu") == 700 * MIB  # MLX's buffers are in RSS already
    assert measured_memory(sample, mlx, "metal") == 700 * MIB  # shared memory: RSS-based, as before


def test_the_gpus_free_memory_comes_from_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cuda_free_memory() is None  # no nvidia-smi: the caller falls back to the machine's memory
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "args"}\necho 81559\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert cuda_free_memory() == 81559 * MIB
    assert "--id=3" in (tmp_path / "args").read_text()  # the first GPU the runner will see


def test_admission_on_this_machine_uses_its_devices_free_memory():
    backend = expected_backend()
    assert expected_device() == ("cpu" if backend == "cpu" else "gpu")
    expected = cuda_free_memory() if backend == "cuda" else None
    assert abs(free_memory() - (expected or psutil.virtual_memory().available)) < 512 * MIB
    assert free_memory(123) == 123


def test_the_runner_names_its_device_and_backend():
    from runner import platform

    on_cpu = platform.device_name() == "cpu"
    assert platform.backend() == (expected_backend() if not on_cpu else "cpu")
    assert platform.describe().startswith("the CPU (" if on_cpu else f"the GPU ({platform.backend()}: ")
    assert platform.auto_dtype() == ("float32" if on_cpu else "checkpoint")
    assert platform.device_memory() > 0 or on_cpu


def test_the_device_script_runs_its_quick_parts_on_the_cpu(tmp_path):
    """bench/device.py's parts at --quick sizes print their tables (the full script is bench/device.sh)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.device", "env", "forward", "memory", "new_shapes", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**child_environment(), "OUT": str(tmp_path)},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| serving on | the " in out
    assert out.count("## forward pass:") == 2 and "| 4 |" in out  # both models, up to 4 rows
    rows = [line for line in out.splitlines() if line.startswith("| on |") or line.startswith("| off |")]
    assert len(rows) == 2 and int(rows[0].split("|")[2]) > 0 and int(rows[1].split("|")[2]) == 0  # releases
    shapes = [line for line in out.splitlines() if line.startswith(("| plain |", "| draft model, k = "))]
    assert len(shapes) == 3 and all(float(cell) > 0 for line in shapes for cell in line.split("|")[2:6])
