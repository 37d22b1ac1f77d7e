"""Shared fixtures: the embedded default model pair, loaded once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import mlx.core as mx
import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.loading.row_padding import MEMO_ENV

# Row padding's measured times go to a file of this session's (every runner it starts inherits the setting), not the
# user's cache: times measured while tests load the CPU must not decide a later serve's row padding.
if MEMO_ENV not in os.environ:  # set once, by the process that starts the session (xdist's workers inherit it)
    _memo_folder = tempfile.mkdtemp(prefix="mlxserve-tests-")
    os.environ[MEMO_ENV] = os.path.join(_memo_folder, "row_padding.json")
    atexit.register(shutil.rmtree, _memo_folder, True)


@pytest.fixture(scope="session")
def engine() -> Engine:
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings())


@pytest.fixture(scope="session")
def chat_supervisor(tmp_path_factory):
    """One supervisor for the client API tests (OpenAI's, Anthropic's, Ollama's): SmolLM2 ("smol", the
    chat model), the default pair ("pair", no chat template, speculates; a client may let 128 rounds wait, so a
    client that stops reading is cut off within seconds), a model with no queue ("busy") and SmolLM2 with greedy
    sampling defaults, loaded on first use ("claude")."""
    from common.defaults import SMOLLM2_DIR
    from tests.helpers import CHAT_TOKEN
    from tests.processes import SupervisorProcess, free_port, model_toml

    models = (
        model_toml("smol", target=SMOLLM2_DIR, draft=None)
        + model_toml("pair", max_pending_rounds=128)
        + model_toml("busy", max_queue=0, max_batch=1)
        # SmolLM2 greedy unless a request says otherwise, loaded on first use (Claude Code sends no temperature)
        + model_toml("claude", target=SMOLLM2_DIR, draft=None, load_at_start=False)
        + "sampling = {temperature = 0}\n"
    )
    # With the cyclic collector off, a stream whose runner call were released only when collected stays held.
    sup = SupervisorProcess(
        tmp_path_factory.mktemp("chat"),
        models,
        collector=False,
        auth_token=CHAT_TOKEN,
        log_format="json",
        ollama_listen=f"127.0.0.1:{free_port()}",  # Ollama's API on an address of its own as well
    ).wait_ready(180)
    yield sup
    assert sup.stop() == 0


@pytest.fixture(scope="session")
def chat_client(chat_supervisor):
    """The official ``openai`` client of ``chat_supervisor``."""
    return chat_supervisor.openai()


@pytest.fixture
def restore_cache_limit():
    """Engines set MLX's process-wide pool cap; put it back after the test."""
    previous = mx.set_cache_limit(0)
    mx.set_cache_limit(previous)
    yield
    mx.set_cache_limit(previous)
    mx.clear_cache()
