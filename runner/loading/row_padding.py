"""Single-row matrix products run as two rows, on the CPU with MKL.

A decoding step multiplies one row (one token) by every weight matrix. MKL
sends a one-row product to its matrix-vector kernel, which on this project's
machines (AMD EPYC, MKL, sequential) streams the weights at about half the
speed of its two-row matrix kernel. So a one-row input is broadcast to two
identical rows, multiplied, and the first row kept; the second row's
arithmetic costs less than the slower kernel loses, and a one-token forward
pass costs what a two-token verify pass costs. The figures are in
docs/design.md ("The CPU's BLAS").

The rule touches only float ``Linear`` layers and tied embeddings used as the
output projection (``Embedding.as_linear``), and only inputs of exactly one
row; batched steps (one row per request, several requests) and prompt chunks
already have several rows and run as before. Quantized layers use MLX's own
kernels, not BLAS, and are left alone. Each row of a product is computed on
its own, so the kept row is the product of the one input row; tests check
that greedy output does not change.

Whether it pays depends on the CPU (issue #40): on the EPYC it was decided on, two rows were faster; on a
Xeon they were not (plain decoding 0.79x mlx-lm's). So where it may apply (the CPU device with MKL preloaded,
``common.cpu_blas``: ``applies()``), ``decide()`` measures it on the model as it loads: one-token decoding
steps one row and two rows, alternated, each for a short time, and pads only where two rows are clearly
faster; the reason, with both times, is in the runner's Info. The times are remembered per machine and model
(``~/.cache/mlxserve/row_padding.json``, or under ``$XDG_CACHE_HOME``: keyed by the CPU, MLX's version, the
model's folder and config and the dtype; the ``REMEMBERED`` most recently measured; ``MLXSERVE_ROW_PADDING_MEMO``
names another file, as the tests do), so a restart does not measure again. ``MLXSERVE_ROW_PADDING=0`` or
``=1`` overrides it all.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from common import cpu_blas

ENV = "MLXSERVE_ROW_PADDING"
MEMO_ENV = "MLXSERVE_ROW_PADDING_MEMO"  # the file the times are remembered in, where not the user's cache (the tests')


MEASURE_SECONDS = 0.12  # each variant's share of one of the measuring rounds
MEASURE_ROUNDS = 3  # rounds of both variants, the order alternated
MARGIN = 0.97  # two rows must take less than this share of one row's time: they cost twice the arithmetic
REMEMBERED = 256  # models whose times are kept per machine (each folder a model is loaded from is one)


def applies() -> bool:
    setting = os.environ.get(ENV)
    if setting in ("0", "1"):
        return setting == "1"
    return mx.default_device() == mx.cpu and cpu_blas.is_loaded()


def decide(model, identity: str = "") -> tuple[int, str]:
    """Pad ``model``'s one-row products where that is faster here: (padded layers, why), measured where the rule
    may apply (or remembered from a measurement of the same model on this machine: ``identity`` names it, "" to
    measure always), else as the environment or the device says."""
    setting = os.environ.get(ENV)
    if setting in ("0", "1"):
        return (pad_single_rows(model) if setting == "1" else 0), f"{ENV}={setting}"
    if not applies():
        return 0, "off: not the CPU with MKL"
    key = _key(identity) if identity else ""
    times = _remembered(key)
    how = "remembered"
    if times is None:
        times, how = measure(model), "measured at load"
        mx.clear_cache()  # the measuring cache's buffers
        _remember(key, times)
    one, two = times
    padded = pad_single_rows(model) if two < MARGIN * one else 0
    verdict = "on" if padded else "off"
    return padded, f"{verdict}: {how}, one row {one * 1e3:.2f} ms, two rows {two * 1e3:.2f} ms a step"


def _memo() -> Path:
    if os.environ.get(MEMO_ENV):
        return Path(os.environ[MEMO_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlxserve" / "row_padding.json"


def _key(identity: str) -> str:
    cpu = ""
    try:
        cpu = next((line for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    text = "|".join((cpu.strip(), str(os.cpu_count()), mx.__version__, identity))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _remembered(key: str) -> tuple[float, float] | None:
    if not key:
        return None
    try:
        found = json.loads(_memo().read_text()).get(key)
        return (float(found[0]), float(found[1])) if found else None
    except (OSError, ValueError, TypeError, IndexError):
        return None


def _remember(key: str, times: tuple[float, float]) -> None:
    """Keep the times for ``key`` (best effort: a folder that cannot be written is measured again next time)."""
    if not key:
        return
    path = _memo()
    try:
        known = json.loads(path.read_text()) if path.exists() else {}
        known.pop(key, None)
        known[key] = list(times)  # the newest last: past REMEMBERED entries, the oldest are forgotten
        known = dict(list(known.items())[-REMEMBERED:])
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{os.getpid()}.tmp")
        scratch.write_text(json.dumps(known))
        scratch.replace(path)
    except (OSError, ValueError):
        pass


def measure(model) -> tuple[float, float]:
    """Median seconds of a one-token decoding step of ``model`` run one row and two rows (its float products),
    alternated over a few rounds on a short cache; ``model`` is left unpadded."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 16]), cache=cache))
    token = mx.array([[1]])

    def step() -> float:
        started = time.perf_counter()
        mx.eval(model(token, cache=cache))
        return time.perf_counter() - started

    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(MEASURE_ROUNDS):
        for padded in (False, True) if round_ % 2 == 0 else (True, False):
            (pad_single_rows if padded else unpad)(model)
            first = step()  # a warm-up, and the step's cost for how many to time
            steps = max(2, min(16, int(MEASURE_SECONDS / max(first, 1e-4))))
            times[padded] += sorted(step() for _ in range(steps))[steps // 4 : steps - steps // 4] or [first]
    unpad(model)
    return median(times[False]), median(times[True])


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def unpad(model) -> None:
    """Undo ``pad_single_rows``."""
    for _, module in model.named_modules():
        if type(module) is PaddedLinear:
            module.__class__ = nn.Linear
        elif type(module) is PaddedEmbedding:
            module.__class__ = nn.Embedding


def _through_two_rows(product, x: mx.array) -> mx.array:
    """``product(x)``; a one-row ``x`` goes through as two identical rows and the first is kept."""
    if x.ndim >= 2 and x.size == x.shape[-1]:
        return product(mx.broadcast_to(x, (*x.shape[:-2], 2, x.shape[-1])))[..., :1, :]
    return product(x)


class PaddedLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        return _through_two_rows(super().__call__, x)


class PaddedEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return _through_two_rows(super().as_linear, x)


def pad_single_rows(model) -> int:
    """Make ``model``'s float ``Linear`` layers and embeddings pad one-row inputs; returns how many
    layers changed. Subclasses (quantized layers among them) are left as they are."""
    changed = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
            module.__class__ = PaddedLinear
            changed += 1
        elif type(module) is nn.Embedding:
            module.__class__ = PaddedEmbedding
            changed += 1
    return changed
