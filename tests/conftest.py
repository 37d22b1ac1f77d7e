"""Shared fixtures: the embedded default model pair, loaded once per session."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

from runner.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from runner.engine import Engine, EngineSettings


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, EngineSettings())


@pytest.fixture
def restore_cache_limit():
    """Engines set MLX's process-wide pool cap; put it back after the test."""
    previous = mx.set_cache_limit(0)
    mx.set_cache_limit(previous)
    yield
    mx.set_cache_limit(previous)
    mx.clear_cache()


def collect(rounds):
    """All token ids, the whole text and the final round of a generation."""
    tokens, text, last = [], "", None
    for last in rounds:
        tokens += last.token_ids
        text += last.text
    return tokens, text, last


def draft_with_swapped_vocabulary(folder):
    """A copy of the default draft whose tokenizer has the same size but two ids swapped."""
    shutil.copytree(DEFAULT_DRAFT, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder
