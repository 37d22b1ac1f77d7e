"""Multimodal rotary positions (Qwen2-VL's M-RoPE) on mlx-lm's text model (issue #39).

Qwen2-VL, Qwen2.5-VL and Qwen3.5 give each token three positions (time, row, column), split over the rotary frequencies
in sections. A text token's three are equal, and then M-RoPE is exactly the plain rotary embedding of that
position: so mlx-lm's ``qwen2`` decodes these models' text as it decodes Qwen2's. An image is different: its
tokens take the image's grid as positions (16 tokens of a 4x4 grid span 4 positions, not 16), and the text after
it goes on from the largest position + 1. So for an image request:

* the prefill of a prompt part that holds image tokens is given explicit (3, 1, L) positions, which mlx-vlm's
  own ``get_rope_index`` computes once for the whole prompt (``Vision.input``), rotated by mlx-vlm's own rotary
  embedding of that attention layer (its sections, its layout);
* every other pass (the text after the last image, decoding, speculation's verify passes, a batch's steps) is
  the plain rotary embedding at ``cache offset + delta``, the request's delta being (largest position + 1) -
  prompt length, fixed for the request. A batch passes one delta per row, as mlx-lm's batched cache passes one
  offset per row.

Qwen3-VL adds deepstack: the vision tower's features from some of its inner blocks (each through its own
merger) are added to the image tokens' hidden states after the first text layers, one set per layer. A prefill
part that holds image tokens carries them (``Positions.deepstack``: per layer, the part's rows with the features
where its image tokens are and zeros elsewhere), and those layers add them (``install``'s ``deepstack`` layers).

The positions live in one ``Positions`` object per model that every attention layer's rope reads
(``MRope``); ``PositionedModel`` sets it around each forward pass (the pass is built as it is called, so the
positions are in its graph when it returns) and puts it back after. Text requests pass delta 0: their rope is
mlx-lm's own.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Vision-language families with M-RoPE whose language model is mlx-lm's text class of that name (Qwen3.5's is
# hybrid: Gated DeltaNet layers, which have no positions, between its attention layers).
TEXT_MODEL = {
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "qwen3_vl_moe": "qwen3_moe",
    "qwen3_5": "qwen3_5",
}


class Positions:
    """The positions the text model's next forward pass takes."""

    def __init__(self):
        self.delta: int | mx.array = 0  # added to the cache's offset: an int, or one per row of a batch
        self.explicit: mx.array | None = None  # (3, 1, L) positions of a prefill part that holds image tokens
        self.deepstack: mx.array | None = None  # (layers, 1, L, hidden): added after each of the first layers


class MRope(nn.Module):
    """One attention layer's rope: mlx-lm's (``rope``) at offset + delta, or mlx-vlm's multimodal rotary embedding
    of the same layer (``rotary``) at explicit positions."""

    def __init__(self, rope, rotary, positions: Positions):
        super().__init__()
        self.rope = rope
        self._rotary = rotary  # not a child module: mlx-vlm's model owns it (and no parameter lives in it)
        self._positions = positions

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        explicit = self._positions.explicit
        if explicit is not None:
            rotated, _ = self._rotary.apply_rotary(x, x, explicit, unsqueeze_dim=1)
            return rotated.astype(x.dtype)
        delta = self._positions.delta
        return self.rope(x, offset=offset + delta if not (isinstance(delta, int) and delta == 0) else offset)


class _Deepstack:
    """A decoder layer that adds its share of the deepstack features (``Positions.deepstack``) to its output."""

    def __call__(self, x, *args, **kwargs):
        out = super().__call__(x, *args, **kwargs)
        added = self._positions.deepstack
        return out if added is None else out + added[self._deepstack_index].astype(out.dtype)


_DEEPSTACK_CLASSES: dict[type, type] = {}


def _deepstack_class(base: type) -> type:
    if base not in _DEEPSTACK_CLASSES:
        _DEEPSTACK_CLASSES[base] = type(f"Deepstack{base.__name__}", (_Deepstack, base), {})
    return _DEEPSTACK_CLASSES[base]


def install(text_model, language_model, deepstack: int = 0) -> Positions:
    """Give each attention of mlx-lm's ``text_model`` an ``MRope`` over its own rope and the rotary embedding of
    the same layer of mlx-vlm's ``language_model``, and its first ``deepstack`` layers the deepstack features.
    Returns the positions they read."""
    positions = Positions()
    theirs = language_model.model.layers
    ours = text_model.model.layers if hasattr(text_model, "model") else text_model.layers
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} text layers against mlx-vlm's {len(theirs)}")
    for layer, their in zip(ours, theirs):
        if hasattr(layer, "self_attn"):  # not a linear-attention layer (Qwen3.5's Gated DeltaNet)
            layer.self_attn.rope = MRope(layer.self_attn.rope, their.self_attn.rotary_emb, positions)
    for index, layer in enumerate(ours[:deepstack]):  # the same module, its class one that adds (names unchanged)
        layer.__class__ = _deepstack_class(type(layer))
        layer._positions, layer._deepstack_index = positions, index
    return positions


def rope_delta(prepared) -> int:
    """A prepared request's delta: its image input's (``runner.vision.VisionInput``), 0 for text."""
    seen = prepared.vision_input
    return 0 if seen is None else seen.rope_delta


class PositionedModel:
    """The text model as one image request's decoder (``delta()`` an int) or a batch (one per row) calls it:
    positions set around each pass; ``positions=`` (explicit, numpy or MLX, (3, L)) and ``deepstack=`` ((layers,
    L, hidden)) for a prefill part that holds image tokens."""

    def __init__(self, model, positions: Positions, delta):
        self.model = model
        self._positions = positions
        self._delta = delta

    def __call__(self, inputs, *args, positions=None, deepstack=None, **kwargs):
        delta = self._delta()
        if isinstance(delta, (list, tuple)):
            delta = 0 if not any(delta) else mx.array(delta)
        self._positions.delta = delta
        if positions is not None:
            self._positions.explicit = mx.array(positions)[:, None, :]
        if deepstack is not None:
            self._positions.deepstack = deepstack[:, None]
        try:
            return self.model(inputs, *args, **kwargs)
        finally:
            self._positions.delta = 0
            self._positions.explicit = None
            self._positions.deepstack = None

    def __getattr__(self, name):  # layers, args, make_cache...: the model's own
        return getattr(self.model, name)
