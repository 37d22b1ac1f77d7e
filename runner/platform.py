"""Which device and backend MLX serves on, in words, and what follows from it.

MLX runs on Apple GPUs (Metal), NVIDIA GPUs (CUDA, the ``mlx[cuda12]`` /
``mlx[cuda13]`` wheels) and the CPU. What was decided on CPU timings applies on
the CPU only: float32 for ``dtype = "auto"`` (``common.footprint.resolve_dtype``),
the MKL preload (``common.cpu_blas``), one-row padding (``runner.loading.row_padding``)
and the prefill's cap on the attention score matrix (``runner.prefill``). On a
GPU, the checkpoint's form is kept and the others are off. Info and the
start-up line name the device and the backend with ``describe()``.
"""

from __future__ import annotations

import mlx.core as mx


def device_name() -> str:
    """``"cpu"`` or ``"gpu"``: MLX's default device."""
    return mx.default_device().type.name


def backend() -> str:
    """``"cuda"``, ``"metal"`` or ``"cpu"``: what runs MLX's default device."""
    if device_name() == "cpu":
        return "cpu"
    if mx.cuda.is_available():
        return "cuda"
    return "metal" if mx.metal.is_available() else "gpu"


def device_memory() -> int:
    """Bytes of the default device's own memory (a GPU's; the CPU's is the system's), 0 when MLX does not say."""
    info = mx.device_info()
    return int(info.get("total_memory") or info.get("memory_size") or 0)


def describe() -> str:
    """For example ``the GPU (cuda: NVIDIA H200, 140 GiB)`` or ``the CPU (x86_64, Intel Xeon)``."""
    info = mx.device_info()
    name = info.get("device_name") or info.get("architecture") or "unknown"
    if device_name() == "cpu":
        from common import cpu_blas

        return f"the CPU ({info.get('architecture', '?')}, {name}{', MKL' if cpu_blas.is_loaded() else ''})"
    memory = device_memory()
    return f"the GPU ({backend()}: {name}{f', {memory / 2**30:.0f} GiB' if memory else ''})"


def auto_dtype() -> str:
    """What ``dtype = "auto"`` becomes before memory is considered: float32 on the CPU, else the checkpoint's."""
    return "float32" if device_name() == "cpu" else "checkpoint"
