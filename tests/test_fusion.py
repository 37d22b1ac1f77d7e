"""Projections that read one input run as one product (runner.loading.fusion): the same logits, the weights once."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from common.defaults import DEFAULT_TARGET
from runner.loading import fusion
from runner.loading.adapters import MultiLoRALinear
from runner.loading.load import load_model
from tests.test_row_padding import greedy


@pytest.fixture(scope="module")
def both():
    """The default target loaded twice in float32: stacked (the default) and as mlx-lm ships it. Both with one-row
    products run as they are: row padding, measured at each load, can decide one way for one and the other way for
    the other on a busy machine, and a one-row product padded to two is another kernel, with other roundings."""
    return (
        load_model(DEFAULT_TARGET, "float32", row_padding=False),
        load_model(DEFAULT_TARGET, "float32", row_padding=False, fuse=False),
    )


def sizes(model) -> dict[str, int]:
    return {name: value.size for name, value in tree_flatten(model.parameters())}


def test_each_layer_runs_one_product_for_q_k_v_and_one_for_gate_up(both):
    stacked, plain = both
    assert stacked.fused_groups == 16 and stacked.fusion.startswith("on: 8 q/k/v and 8 gate/up groups")
    assert plain.fused_groups == 0 and plain.fusion == "off: asked"
    layer = stacked.model.model.layers[0]
    assert isinstance(layer.self_attn.fused_qkv, nn.Linear) and layer.self_attn.fused_qkv.weight.shape == (
        384 + 2 * 128,
        384,
    )
    assert isinstance(layer.mlp.fused_gate_up, nn.Linear) and layer.mlp.fused_gate_up.weight.shape == (2 * 1024, 384)
    # the weights are held once: the same number of values, the old matrices gone
    assert sum(sizes(stacked.model).values()) == sum(sizes(plain.model).values())
    assert not any(name.endswith(("q_proj.weight", "gate_proj.weight")) for name in sizes(stacked.model))
    # a part's rows are the old matrix's
    assert mx.array_equal(layer.self_attn.k_proj.weight, plain.model.model.layers[0].self_attn.k_proj.weight).item()


def test_greedy_decoding_and_logits_are_the_same_as_mlx_lm_layers(both):
    stacked, plain = both
    prompt = stacked.tokenizer.encode("The for statement is used to iterate over the elements of a sequence")
    assert greedy(stacked.model, prompt, 160) == greedy(plain.model, prompt, 160)
    for rows in (1, 4, 37):  # a decoding step, a verify pass, a prompt chunk
        ids = mx.array([list(range(5, 5 + rows))])
        a = stacked.model(ids, cache=make_prompt_cache(stacked.model))
        b = plain.model(ids, cache=make_prompt_cache(plain.model))
        assert mx.array_equal(a, b).item(), rows


def test_nothing_is_held_between_passes(both):
    stacked, _ = both
    stacked.model(mx.array([[5, 6, 7]]), cache=make_prompt_cache(stacked.model))
    parts = [m for _, m in stacked.model.named_modules() if isinstance(m, fusion.Part)]
    assert len(parts) == 8 * 5 and all(p._stack._input is None and p._stack._columns is None for p in parts)


def test_an_adapter_wraps_a_part_as_it_wraps_a_linear_layer(both):
    stacked, plain = both
    x = mx.random.normal((1, 3, 384), key=mx.random.key(0))
    part = stacked.model.model.layers[1].self_attn.v_proj
    rows = type("Rows", (), {"rows": (1,)})()
    a, b = mx.random.normal((2, 384, 4), key=mx.random.key(1)), mx.random.normal((2, 4, 128), key=mx.random.key(2))
    wrapped = MultiLoRALinear(part, a, b, mx.array([0.0, 2.0]), rows)
    expected = plain.model.model.layers[1].self_attn.v_proj(x) + 2.0 * ((x @ a[1]) @ b[1])
    assert mx.allclose(wrapped(x), expected, atol=1e-4).item()


class Crossed(nn.Module):
    """An attention-like layer that feeds its key projection another input than its query projection."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8) for _ in range(3))

    def __call__(self, x):
        return self.q_proj(x) + self.k_proj(2 * x) + self.v_proj(x)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 8)
        self.layers = [Crossed()]

    def __call__(self, ids, cache=None):
        return self.layers[0](self.embed(ids))


def test_a_layer_that_feeds_its_parts_different_inputs_is_left_as_it_was():
    toy = Toy()
    mx.eval(toy.parameters())
    before = {name: mx.array(value) for name, value in tree_flatten(toy.parameters())}
    groups, why = fusion.fuse(toy)
    assert groups == 0 and why == "off: the layers do not feed each stacked projection one input"
    after = dict(tree_flatten(toy.parameters()))
    assert after.keys() == before.keys() and all(mx.array_equal(after[k], before[k]).item() for k in before)
    assert all(type(getattr(toy.layers[0], n)) is nn.Linear for n in ("q_proj", "k_proj", "v_proj"))


def test_a_model_with_nothing_to_stack_is_not_run_to_check_it(both, monkeypatch):
    stacked, _ = both
    runs = []
    monkeypatch.setattr(fusion, "_logits", lambda model, rows: runs.append(rows))
    assert fusion.fuse(stacked.model) == (0, "off: no projections to stack") and runs == []  # stacked already


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv(fusion.ENV, "0")
    loaded = load_model(DEFAULT_TARGET, "float32")
    assert loaded.fused_groups == 0 and loaded.fusion == f"off: {fusion.ENV}=0"


def test_quantized_projections_stack_as_they_are_with_the_same_logits():
    """A quantized checkpoint's layers (the form a GPU runs) stack their packed weights, scales and biases; a group
    whose layers are quantized differently (Q4_K_M's 6-bit value projections) is left apart."""
    loaded = load_model(DEFAULT_TARGET, "float32", fuse=False)
    nn.quantize(loaded.model, group_size=64, bits=4)
    attention = loaded.model.model.layers[0].self_attn
    attention.v_proj = nn.QuantizedLinear.from_linear(nn.Linear(384, 128), group_size=64, bits=8)
    mx.eval(loaded.model.parameters())
    ids = mx.array([[5, 9, 14, 2, 33]])
    before = loaded.model(ids, cache=make_prompt_cache(loaded.model))
    groups, why = fusion.fuse(loaded.model)
    assert groups == 7 + 8 and why.startswith("on: 7 q/k/v and 8 gate/up groups"), why
    assert "fused_qkv" not in attention and type(attention.q_proj) is nn.QuantizedLinear
    stacked = loaded.model.model.layers[1].mlp.fused_gate_up
    assert type(stacked) is nn.QuantizedLinear and stacked.bits == 4 and stacked.scales.shape == (2 * 1024, 384 // 64)
    assert mx.array_equal(loaded.model(ids, cache=make_prompt_cache(loaded.model)), before).item()
