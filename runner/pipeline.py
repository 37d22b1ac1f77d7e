"""Pipeline parallelism for a runner group: each rank holds a run of the target's layers.

Where tensor parallelism (mlx-lm's ``model.shard``) splits every layer's heads, a pipeline splits the
stack: rank N-1 runs the first layers, sends its hidden state to rank N-2, ... and rank 0 runs the last
ones; one ``all_gather`` then gives every rank rank 0's final hidden state, so every rank computes the same
logits (the embeddings, the final norm and the head are whole on every rank) and the group's step loop
(``runner.worker``, ``runner.group``) is the same as with tensor parallelism. This is mlx-lm's layout
(``mlx_lm.models.pipeline.PipelineMixin``): the order puts the logits on rank 0, which serves.

It is for a model that does not fit one process (each rank holds its layers' weights and KV cache), not
for speed: a lone request's forward pass visits the ranks one after another, and the hops cost time.
It also splits models tensor parallelism cannot split evenly (SmolLM2's 9 heads), as long as the stack
has at least one layer per rank.

Two ways in: a model whose mlx-lm class has the mixin (qwen2, the deepseek family, ...) uses it; the
plain decoder stacks below (one causal mask for every layer, ``for layer, c in zip(self.layers, cache)``)
get the same behaviour by wrapping their first and last local layer. MLX's CUDA backend (NCCL) has no
send/recv, so a pipeline needs the ring (or MPI, JACCL) backend.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

# Architectures whose inner model calls every layer with one mask made from ``cache[0]`` (checked against
# mlx-lm 0.32's llama.py and qwen3.py): wrapping the first and last local layer pipelines them.
WRAPPED_KINDS = frozenset({"llama", "mistral", "qwen3"})


def pipeline_problem(folder: Path, ranks: int, backend: str = "ring") -> str:
    """Why the model in ``folder`` cannot be pipelined across ``ranks`` processes ("" when it can)."""
    from .loading.architecture import architecture

    try:
        config, model_class = architecture(folder)
    except ValueError as error:
        return str(error)
    kind = config.get("model_type", "?")
    if backend == "nccl":
        return "MLX's NCCL backend has no send/recv, which a pipeline needs"
    native = has_mixin(model_class)
    if not native and kind not in WRAPPED_KINDS:
        return f"mlx-lm has no pipeline for a {kind} model and its layers are not a plain stack"
    if native and hasattr(model_class, "make_cache"):  # hybrids (qwen3_next, ...): ranks would differ in kind
        return "its layers keep caches of different kinds, which a pipeline's ranks would count and trim unalike"
    layer_types = config.get("layer_types") or []
    if not native and any(t != "full_attention" for t in layer_types):
        return "its layers mix sliding-window and full attention (one mask per layer kind)"
    layers = int(config.get("num_hidden_layers") or 0)
    if layers < ranks:
        return f"its {layers} layers cannot be split {ranks} ways"
    return ""


def has_mixin(model_class) -> bool:
    """Whether ``model_class``'s module builds its inner model on mlx-lm's pipeline mixin."""
    from mlx_lm.models.pipeline import PipelineMixin

    module = sys.modules[model_class.__module__]
    return any(isinstance(v, type) and issubclass(v, PipelineMixin) for v in vars(module).values())


def split_layers(count: int, ranks: int) -> list[int]:
    """Layers per rank, in rank order: an even split, the low ranks (the last layers) taking the extras."""
    base, extra = divmod(count, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


class _Receive(nn.Module):
    """A rank's first layer when an earlier rank runs the layers before it: its input comes from that rank."""

    def __init__(self, layer: nn.Module, source: int, group):
        super().__init__()
        self.layer = layer
        self.use_sliding = getattr(layer, "use_sliding", False)
        self._source = source
        self._group = group

    def __call__(self, x, *args, **kwargs):
        x = mx.distributed.recv_like(x, self._source, group=self._group)
        return self.layer(x, *args, **kwargs)


class _Hand(nn.Module):
    """A rank's last layer: its output goes to the rank that runs the next layers (if any), then every rank
    takes rank 0's final hidden state."""

    def __init__(self, layer: nn.Module, destination: int | None, group):
        super().__init__()
        self.layer = layer
        self.use_sliding = getattr(layer, "use_sliding", False)
        self._destination = destination
        self._group = group

    def __call__(self, x, mask=None, cache=None):
        h = self.layer(x, mask, cache=cache)
        if self._destination is not None:
            h = mx.distributed.send(h, self._destination, group=self._group)
            if cache is not None:  # evaluating the cache alone (a prefill chunk) must still send
                _depend(cache, h)
        return mx.distributed.all_gather(h, group=self._group)[: h.shape[0]]


def _depend(cache, h) -> None:
    keys = getattr(cache, "keys", None)
    if isinstance(keys, mx.array):
        cache.keys = mx.depends(keys, h)
    elif isinstance(keys, (tuple, list)) and keys:  # a quantized cache: (packed, scales, biases)
        cache.keys = (mx.depends(keys[0], h), *keys[1:])


def pipeline(model: nn.Module, group) -> tuple[int, int]:
    """Keep this rank's run of ``model``'s layers (``group``: an ``mx.distributed.Group``); returns the
    (start, end) layer indexes kept. The others' weights are dropped."""
    inner = model.model
    rank, size = group.rank(), group.size()
    if hasattr(inner, "pipeline"):  # mlx-lm's mixin
        inner.pipeline(group)
        kept = [layer for layer in inner.layers if layer is not None]
        inner.layers = kept
        start = inner.start_idx
        inner.start_idx, inner.end_idx = 0, None  # the list now holds only this rank's layers
        return start, start + len(kept)
    split = split_layers(len(inner.layers), size)
    start = sum(split[rank + 1 :])
    end = start + split[rank]
    local = list(inner.layers[start:end])
    if rank < size - 1:  # an earlier rank runs the layers before these
        local[0] = _Receive(local[0], rank + 1, group)
    local[-1] = _Hand(local[-1], rank - 1 if rank > 0 else None, group)
    inner.layers = local
    return start, end
