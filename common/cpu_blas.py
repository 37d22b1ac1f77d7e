"""A fast BLAS for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel links the reference (netlib) BLAS, which on this kind of
machine multiplies matrices ~25x slower than an optimised one. Intel's MKL
(the ``mkl`` wheel, a Linux x86_64 dependency of this project) exports the
same ``cblas_*`` symbols, so preloading ``libmkl_rt`` makes MLX use it without
rebuilding anything. The preload has to be in place when the process starts,
so processes we launch get it through their environment, and entry points
re-execute themselves once with it.

Set ``MLXSERVE_BLAS=reference`` to keep the wheel's own BLAS.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_MARK = "MLXSERVE_BLAS_PRELOADED"


def mkl_library() -> Path | None:
    if not sys.platform.startswith("linux") or os.environ.get("MLXSERVE_BLAS") == "reference":
        return None
    for candidate in sorted((Path(sys.prefix) / "lib").glob("libmkl_rt.so*")):
        return candidate
    return None


def fast_blas_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: os.environ) plus what preloads MKL, when it is installed."""
    env = dict(os.environ if base is None else base)
    library = mkl_library()
    if library is None:
        return env
    preload = env.get("LD_PRELOAD", "")
    if str(library) not in preload.split(":"):
        env["LD_PRELOAD"] = f"{library}:{preload}" if preload else str(library)
    # One thread per process: runners already run side by side, one per model.
    env.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL")
    env[_MARK] = "1"
    return env


def is_loaded() -> bool:
    try:
        return "libmkl_rt" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def reexec_with_fast_blas() -> None:
    """Restart this interpreter with MKL preloaded, once, if it is available and not yet loaded."""
    if mkl_library() is None or is_loaded() or os.environ.get(_MARK):
        return
    env = fast_blas_environment()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":
    # Shell form, for the Makefile: `env $(python -m common.cpu_blas) cmd ...`
    env = fast_blas_environment({})
    print(" ".join(f"{k}={v}" for k, v in env.items() if k != _MARK))
