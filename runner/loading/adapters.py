"""LoRA adapters over one base model: several in one runner, one copy of the base, chosen per request.

An adapter is mlx-lm's folder (``adapter_config.json`` with ``fine_tune_type`` "lora" and its
``lora_parameters``, and ``adapters.safetensors`` holding each adapted layer's ``lora_a`` (in x r) and
``lora_b`` (r x out)), as ``mlx_lm.lora`` writes it and ``mlx_lm.load(..., adapter_path=...)`` reads it.

Each linear layer that any adapter adapts is wrapped once (``MultiLoRALinear``): the base layer, and the
adapters' A and B stacked (index 0 is no adapter: zeros; ranks padded to the largest with zeros) with their
scales. A forward pass reads which adapter each row of its batch uses from the runner's one ``AdapterRows``
(set just before the pass by ``with_adapters``' wrapper around the target model), so requests with different
adapters, and requests with none, decode as rows of one batch: each row adds ``scale * (x @ A) @ B`` of its
own adapter, as mlx-lm's ``LoRALinear`` adds it. A pass whose rows all use none costs nothing more.

Not fused into the weights (one base is shared), DoRA and full fine-tunes are refused with the reason. The
draft model has no adapters: it drafts for the base, and the target verifies what the adapter makes of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from common.errors import ModelLoadError


class AdapterRows:
    """Which adapter each row of the next forward pass uses (0: none); set on the MLX thread before each pass."""

    def __init__(self):
        self.rows: tuple[int, ...] = ()


class MultiLoRALinear(nn.Module):
    """A linear layer with several LoRA adapters, one chosen per row of each forward pass."""

    def __init__(self, base: nn.Module, a: mx.array, b: mx.array, scales: mx.array, rows: AdapterRows):
        super().__init__()
        self.base = base
        self.lora_a = a  # (adapters + 1, in, rank): index 0 is zeros
        self.lora_b = b  # (adapters + 1, rank, out)
        self.lora_scales = scales  # (adapters + 1,)
        self._rows = rows

    def __call__(self, x):
        y = self.base(x)
        rows = self._rows.rows
        if not any(rows):
            return y
        if len(rows) == 1 or len(set(rows)) == 1:  # one adapter for every row: plain matrices
            index = rows[0]
            z = (x @ self.lora_a[index]) @ self.lora_b[index]
            return y + (self.lora_scales[index] * z).astype(x.dtype)
        index = mx.array(rows)
        z = (x @ self.lora_a[index]) @ self.lora_b[index]  # (B, L, in) @ (B, in, r) @ (B, r, out)
        return y + (self.lora_scales[index][:, None, None] * z).astype(x.dtype)


@dataclass(frozen=True)
class Adapter:
    name: str
    path: Path
    rank: int
    scale: float
    layers: tuple[str, ...]  # the adapted modules' paths in the model


def read_adapter(name: str, folder: Path) -> tuple[Adapter, dict[str, mx.array]]:
    """An adapter folder's config and weights; ModelLoadError naming it when it is not a LoRA adapter here."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
        weights = mx.load(str(folder / "adapters.safetensors"))
    except (OSError, ValueError) as error:
        raise ModelLoadError(folder, f"adapter {name}: not an mlx-lm adapter folder ({error})") from None
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ModelLoadError(
            folder, f"adapter {name}: fine_tune_type {kind!r} is not served (LoRA only: one base for every adapter)"
        )
    parameters = config.get("lora_parameters") or {}
    layers = sorted({key.rsplit(".", 1)[0] for key in weights if key.endswith((".lora_a", ".lora_b"))})
    if not layers or any(not key.endswith((".lora_a", ".lora_b")) for key in weights):
        raise ModelLoadError(folder, f"adapter {name}: adapters.safetensors holds no LoRA layers or other weights")
    rank = max(int(weights[f"{layer}.lora_a"].shape[1]) for layer in layers)
    scale = float(parameters.get("scale", 20.0))
    return Adapter(name, folder, rank, scale, tuple(layers)), weights


def with_adapters(model: nn.Module, folders: dict[str, Path]) -> tuple[list[Adapter], AdapterRows]:
    """Wrap ``model``'s adapted linear layers so every adapter in ``folders`` (name -> folder) can be chosen per
    row; returns the adapters in index order (index i + 1 in a request's rows) and the rows switch."""
    rows = AdapterRows()
    adapters, weights = [], []
    for name, folder in folders.items():
        adapter, tensors = read_adapter(name, folder)
        adapters.append(adapter)
        weights.append(tensors)
    modules = dict(model.named_modules())
    rank = max((a.rank for a in adapters), default=0)
    wrapped = {}
    for path in sorted({layer for a in adapters for layer in a.layers}):
        base = modules.get(path)
        if base is None or not hasattr(base, "weight"):
            owner = next(a.name for a in adapters if path in a.layers)
            raise ModelLoadError(adapters[0].path, f"adapter {owner}: the model has no linear layer {path}")
        out_dims = base.weight.shape[0]
        a_rows, b_rows = [], []
        for adapter, tensors in zip(adapters, weights):
            a, b = tensors.get(f"{path}.lora_a"), tensors.get(f"{path}.lora_b")
            if a is None:
                a_rows.append(None)
                b_rows.append(None)
                continue
            if b is None or b.shape[1] != out_dims or a.shape[1] != b.shape[0]:
                raise ModelLoadError(adapter.path, f"adapter {adapter.name}: {path} does not fit the model's layer")
            a_rows.append(a)
            b_rows.append(b)
        in_dims = next(a.shape[0] for a in a_rows if a is not None)
        dtype = base.weight.dtype if base.weight.dtype in (mx.float32, mx.float16, mx.bfloat16) else mx.float32
        stacked_a = [mx.zeros((in_dims, rank), dtype)]
        stacked_b = [mx.zeros((rank, out_dims), dtype)]
        for a, b in zip(a_rows, b_rows):
            if a is None:
                stacked_a.append(mx.zeros((in_dims, rank), dtype))
                stacked_b.append(mx.zeros((rank, out_dims), dtype))
            else:
                pad = rank - a.shape[1]
                stacked_a.append(mx.pad(a.astype(dtype), [(0, 0), (0, pad)]))
                stacked_b.append(mx.pad(b.astype(dtype), [(0, pad), (0, 0)]))
        scales = mx.array([0.0, *(a.scale for a in adapters)], dtype)
        wrapped[path] = MultiLoRALinear(base, mx.stack(stacked_a), mx.stack(stacked_b), scales, rows)
    model.update_modules(_nested(wrapped))
    mx.eval(model.parameters())
    return adapters, rows


def _nested(flat: dict[str, nn.Module]) -> dict:
    """``{"model.layers.0.self_attn.q_proj": m}`` as the nested dicts and lists ``update_modules`` takes."""
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(flat.items()))


class AdaptedModel:
    """The target model as a decoder or a batch calls it, setting each pass's rows first: ``rows()`` gives the
    adapter index of every row of the pass (a session's one, or a batch's rows in order)."""

    def __init__(self, model: nn.Module, switch: AdapterRows, rows):
        self.model = model
        self._switch = switch
        self._rows = rows

    def __call__(self, inputs, *args, **kwargs):
        rows = self._rows()
        self._switch.rows = tuple(rows) if len(rows) == inputs.shape[0] else (rows[0],) * inputs.shape[0]
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):  # layers, args, make_cache...: the model's own
        return getattr(self.model, name)
