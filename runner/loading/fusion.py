"""Projections that read the same input, run as one matrix product.

An attention layer multiplies its input by three matrices (queries, keys and values) and a gated MLP by two
(gate and up). Stacked, each group is one matrix: one product instead of three or two, the same weights read
once, the same arithmetic. At one token a step a product is small, and on the CPU each one pays MKL's fixed
cost: on this project's Xeon (2026-12-06), mlx-lm's ``generate_step`` decoded the default pair's target 1.07x
as fast with its projections stacked (SmolLM2, whose 135M float32 weights make a step a matter of reading
memory, 1.015x), with the same tokens. mlx-lm runs them apart; llama.cpp stacks them for some architectures.

``fuse(model)``: every module with ``q_proj``, ``k_proj`` and ``v_proj`` (and every one with ``gate_proj`` and
``up_proj``) that are all float ``nn.Linear`` or all ``nn.QuantizedLinear`` of one group size, bits and mode,
reading inputs of one width, with biases on all of them or none, gets one layer of that kind (``fused_qkv``,
``fused_gate_up``) holding their rows (a quantized layer's rows are quantized on their own: its packed weights,
scales and biases stack as they are), and the three (two) become ``Part``\\s of
it. The first part asked for an input computes the whole product; the others asked for the same input (the
same array: the layer passes one ``x`` to each) take their columns of it, and once each has, it is forgotten.
A part asked for another input (or twice for one) starts a new product. The layers' code is mlx-lm's, unchanged; LoRA
adapters wrap a part as they wrap a ``Linear`` (``weight`` gives its rows), and one-row padding
(``runner.loading.row_padding``) pads the stacked layer.

Checked as it is done: a short input's logits, one row and several, before and after, must be equal bit for bit,
and each stacked product must have run once per call of its layer (an architecture that feeds the parts different
inputs would compute the whole product for each); otherwise every layer is put back as it was. So stacking
never changes an output. The result, with the reason, is in the runner's Info. ``MLXSERVE_FUSE=0`` turns it off.
"""

from __future__ import annotations

import os

import mlx.core as mx
import mlx.nn as nn

ENV = "MLXSERVE_FUSE"
GROUPS = {"fused_qkv": ("q_proj", "k_proj", "v_proj"), "fused_gate_up": ("gate_proj", "up_proj")}


class _Stack:
    """One stacked product shared by its parts (not a Module: the parameter tree holds the stacked layer once,
    as the owner's ``fused_*``)."""

    def __init__(self, linear: nn.Linear, sizes: list[int]):
        self.linear = linear
        self.bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        self.products = 0  # whole products computed (the check counts them)
        self._input = None
        self._columns: list | None = None
        self._left: set[int] = set()

    def rows(self, index: int) -> slice:
        """Where part ``index``'s rows lie in the stacked layer's arrays."""
        return slice(self.bounds[index], self.bounds[index + 1])

    def columns(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input or index not in self._left:  # a new input: the whole product
            self._columns = mx.split(self.linear(x), self.bounds[1:-1], axis=-1)
            self._input, self._left = x, set(range(len(self.bounds) - 1))
            self.products += 1
        self._left.discard(index)
        out = self._columns[index]
        if not self._left:  # every part has its columns: hold nothing between passes
            self._input = self._columns = None
        return out


class Part(nn.Module):
    """One of a stacked layer's projections: its columns of the stacked product."""

    def __init__(self, stack: _Stack, index: int):
        super().__init__()
        self._stack = stack
        self._index = index

    @property
    def weight(self) -> mx.array:
        return self._stack.linear.weight[self._stack.rows(self._index)]

    def __call__(self, x: mx.array) -> mx.array:
        return self._stack.columns(x, self._index)


KINDS = (nn.Linear, nn.QuantizedLinear)


def _settings(layer) -> tuple:
    """What a layer is besides its arrays: its kind, and a quantized one's group size, bits and mode."""
    if type(layer) is nn.QuantizedLinear:
        return (nn.QuantizedLinear, layer.group_size, layer.bits, layer.mode)
    return (type(layer),)


def _arrays(layer) -> dict[str, mx.array]:
    return {k: v for k, v in layer.items() if isinstance(v, mx.array)}


def _stackable(module, names: tuple[str, ...]) -> list | None:
    layers = [module.get(name) for name in names]
    if not all(type(layer) in KINDS for layer in layers):  # sharded, LoRA, already stacked, anything else: left alone
        return None
    if len({_settings(layer) for layer in layers}) != 1:
        return None
    shapes = [{k: (v.shape[1:], v.dtype) for k, v in _arrays(layer).items()} for layer in layers]
    return layers if all(shape == shapes[0] for shape in shapes) else None  # one input width, one form


def _layer_like(layer, arrays: dict[str, mx.array]):
    """A layer of ``layer``'s kind and settings holding ``arrays`` (rows of its output)."""
    kind, *quantized = _settings(layer)
    if kind is nn.QuantizedLinear:
        group_size, bits, mode = quantized
        new = nn.QuantizedLinear(group_size, 1, "bias" in arrays, group_size=group_size, bits=bits, mode=mode)
        new.pop("biases", None)
    else:
        new = nn.Linear(1, 1, bias="bias" in arrays)
    for key, value in arrays.items():
        setattr(new, key, value)
    return new


def stack(model) -> list[tuple]:
    """Stack every group ``model`` has, a layer at a time (each group's old matrices are freed as its stacked one
    is made, so loading never holds both for more than one group); returns what ``unstack`` needs."""
    done = []
    for _, module in list(model.named_modules()):
        for fused, names in GROUPS.items():
            layers = _stackable(module, names)
            if layers is None:
                continue
            parts = [_arrays(layer) for layer in layers]
            stacked = _layer_like(layers[0], {k: mx.concatenate([p[k] for p in parts], axis=0) for k in parts[0]})
            mx.eval(stacked.parameters())
            shared = _Stack(stacked, [layer.weight.shape[0] for layer in layers])
            setattr(module, fused, stacked)
            for i, name in enumerate(names):
                setattr(module, name, Part(shared, i))
            done.append((module, fused, names, shared))
    return done


def unstack(done: list[tuple]) -> None:
    """Put each group back as layers of their own (copies of the stacked rows)."""
    for module, fused, names, shared in done:
        arrays = _arrays(shared.linear)
        for i, name in enumerate(names):
            rows = shared.rows(i)
            setattr(module, name, _layer_like(shared.linear, {k: mx.array(v[rows]) for k, v in arrays.items()}))
        module.pop(fused, None)
        mx.eval(module.parameters())


def _logits(model, rows: int) -> mx.array:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None) or 98
    ids = mx.array([[(7 * i + 3) % min(97, vocab - 1) + 1 for i in range(rows + 3)]])
    model(ids[:, :3], cache=cache)  # a short context first, so the checked pass also reads a cache
    out = model(ids[:, 3:], cache=cache)
    mx.eval(out)
    return out


def fuse(model) -> tuple[int, str]:
    """Stack ``model``'s projections where the output stays the same: (stacked groups, why)."""
    setting = os.environ.get(ENV)
    if setting == "0":
        return 0, f"off: {ENV}=0"
    if not any(_stackable(module, names) for _, module in model.named_modules() for names in GROUPS.values()):
        return 0, "off: no projections to stack"  # known before the check's passes, which are not run
    try:
        before = [_logits(model, rows) for rows in (1, 5)]
    except Exception as error:  # noqa: BLE001 - a model this check cannot run is left as it is
        return 0, f"off: the check could not run the model ({type(error).__name__})"
    done = stack(model)
    try:
        after = []
        for rows in (1, 5):
            counted = [shared.products for *_, shared in done]
            after.append(_logits(model, rows))
            if any(shared.products - was != 2 for (*_, shared), was in zip(done, counted)):
                unstack(done)
                return 0, "off: the layers do not feed each stacked projection one input"
        same = all(mx.array_equal(a, b).item() for a, b in zip(before, after))
    except Exception as error:  # noqa: BLE001
        unstack(done)
        return 0, f"off: the stacked model failed its check ({type(error).__name__})"
    if not same:
        unstack(done)
        return 0, "off: stacked products change the logits here"
    groups = {name: sum(fused == name for _, fused, *_ in done) for name in GROUPS}
    return len(done), (
        f"on: {groups['fused_qkv']} q/k/v and {groups['fused_gate_up']} gate/up groups, one product each "
        "(logits checked equal at load)"
    )
