"""One-row products run as two rows on the CPU with MKL (runner.loading.row_padding): same results, other kernel."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from common import cpu_blas
from common.defaults import DEFAULT_TARGET
from runner.loading import row_padding
from runner.loading.load import load_model


def greedy(model, prompt: list[int], n: int) -> list[int]:
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out


@pytest.fixture(scope="module")
def both():
    """The default target loaded twice in float32: with the padding forced on, and off."""
    return load_model(DEFAULT_TARGET, "float32", row_padding=True), load_model(
        DEFAULT_TARGET, "float32", row_padding=False
    )


def test_the_rule_applies_on_the_cpu_with_mkl_unless_overridden(monkeypatch):
    monkeypatch.delenv(row_padding.ENV, raising=False)
    assert row_padding.applies() == (mx.default_device() == mx.cpu and cpu_blas.is_loaded())
    monkeypatch.setenv(row_padding.ENV, "0")
    assert not row_padding.applies()
    monkeypatch.setenv(row_padding.ENV, "1")
    assert row_padding.applies()


def test_every_float_linear_and_embedding_is_padded_and_nothing_else(both):
    padded, plain = both
    kinds = [type(m) for _, m in padded.model.named_modules()]
    # 8 layers x 4 products (q/k/v stacked, o, gate/up stacked, down: runner.loading.fusion), the tied embedding (it is
    # also the output projection); no plain Linear left
    assert (
        padded.padded_layers
        == 8 * 4 + 1
        == kinds.count(row_padding.PaddedLinear) + kinds.count(row_padding.PaddedEmbedding)
    )
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert plain.padded_layers == 0 and row_padding.PaddedLinear not in [
        type(m) for _, m in plain.model.named_modules()
    ]


def test_a_padded_layer_gives_each_row_what_the_plain_layer_gives(both):
    padded, plain = both
    layer_p = padded.model.model.layers[0].mlp.gate_proj
    layer_q = plain.model.model.layers[0].mlp.gate_proj
    x = mx.random.normal((1, 1, 384), key=mx.random.key(0))
    rows = mx.random.normal((3, 2, 384), key=mx.random.key(1))
    one_p, one_q = layer_p(x), layer_q(x)
    assert one_p.shape == one_q.shape == (1, 1, 1024)
    assert mx.allclose(one_p, one_q, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(layer_p(rows), layer_q(rows)).item()  # several rows: untouched
    logits_p = padded.model.model.embed_tokens.as_linear(x)
    assert logits_p.shape == (1, 1, 4096)
    assert mx.allclose(logits_p, plain.model.model.embed_tokens.as_linear(x), rtol=1e-5, atol=1e-5).item()


def test_greedy_decoding_is_the_same_with_and_without_padding(both):
    padded, plain = both
    prompt = padded.tokenizer.encode("The for statement is used to iterate over the elements of a sequence")
    assert greedy(padded.model, prompt, 160) == greedy(plain.model, prompt, 160)


def test_left_to_itself_the_runner_measures_which_is_faster_and_says_so(monkeypatch, tmp_path):
    """Whether two rows pay depends on the CPU (issue #40): a model loaded with the rule left to the runner is
    measured one row and two rows as it loads; it pads exactly when two rows were clearly faster, says both
    times in its reason (the runner's Info), and answers as either way. The next load of the same model on this
    machine remembers the times. The environment overrides it."""
    monkeypatch.delenv(row_padding.ENV, raising=False)
    monkeypatch.delenv(row_padding.MEMO_ENV, raising=False)  # the user's cache, as a serve has it
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    loaded = load_model(DEFAULT_TARGET, "float32")
    if not row_padding.applies():
        assert loaded.padded_layers == 0 and loaded.row_padding == "off: not the CPU with MKL"
        return
    assert "measured at load" in loaded.row_padding
    again = load_model(DEFAULT_TARGET, "float32")
    assert again.row_padding == loaded.row_padding.replace("measured at load", "remembered")
    one, two = (float(ms) for ms in re.findall(r"([0-9.]+) ms", loaded.row_padding))
    assert loaded.row_padding.startswith("on" if loaded.padded_layers else "off")
    assert (loaded.padded_layers > 0) == (two < row_padding.MARGIN * one)
    kinds = {type(m) for _, m in loaded.model.named_modules()}
    assert (row_padding.PaddedLinear in kinds) == (loaded.padded_layers > 0)
    monkeypatch.setenv(row_padding.ENV, "1")
    forced = load_model(DEFAULT_TARGET, "float32")
    assert forced.padded_layers == 8 * 4 + 1 and forced.row_padding == f"{row_padding.ENV}=1"
    prompt = loaded.tokenizer.encode("The for statement is used to iterate over the elements of a sequence")
    assert greedy(loaded.model, prompt, 40) == greedy(forced.model, prompt, 40)


def test_the_remembered_times_are_kept_for_the_latest_models_only(monkeypatch, tmp_path):
    """Every folder a model is loaded from is a model to remember (the tests load from many temporary ones): the
    file keeps the ``REMEMBERED`` most recently measured, so it does not grow without end."""
    monkeypatch.delenv(row_padding.MEMO_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(row_padding, "REMEMBERED", 3)
    for i in range(5):
        row_padding._remember(f"model-{i}", (0.002, 0.001 * i))
    row_padding._remember("model-2", (0.002, 0.5))  # measured again: the newest
    assert [row_padding._remembered(f"model-{i}") for i in range(5)] == [
        None,
        None,
        (0.002, 0.5),
        (0.002, 0.003),
        (0.002, 0.004),
    ]
    row_padding._remember("model-5", (0.002, 0.005))
    assert row_padding._remembered("model-3") is None and row_padding._remembered("model-2") == (0.002, 0.5)
    assert (tmp_path / "mlxserve" / "row_padding.json").is_file()
    # MLXSERVE_ROW_PADDING_MEMO names another file (the tests' own, so a test run never decides a serve's padding).
    monkeypatch.setenv(row_padding.MEMO_ENV, str(tmp_path / "elsewhere.json"))
    assert row_padding._remembered("model-5") is None
    row_padding._remember("model-5", (0.002, 0.006))
    assert json.loads((tmp_path / "elsewhere.json").read_text())
    assert row_padding._remembered("model-5") == (0.002, 0.006)
