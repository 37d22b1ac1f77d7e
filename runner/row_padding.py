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

``applies()`` says whether to use it: the CPU device with MKL preloaded
(``common.cpu_blas``). ``MLXSERVE_ROW_PADDING=0`` or ``=1`` overrides that.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

from common import cpu_blas

ENV = "MLXSERVE_ROW_PADDING"


def applies() -> bool:
    setting = os.environ.get(ENV)
    if setting in ("0", "1"):
        return setting == "1"
    return mx.default_device() == mx.cpu and cpu_blas.is_loaded()


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
