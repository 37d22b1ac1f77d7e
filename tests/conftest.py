"""Shared fixtures: the embedded default model pair, loaded once per session."""

from __future__ import annotations

import mlx.core as mx
import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import RunnerSettings
from runner.engine import Engine


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings())


@pytest.fixture
def restore_cache_limit():
    """Engines set MLX's process-wide pool cap; put it back after the test."""
    previous = mx.set_cache_limit(0)
    mx.set_cache_limit(previous)
    yield
    mx.set_cache_limit(previous)
    mx.clear_cache()
