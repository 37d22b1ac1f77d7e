"""An EAGLE-style head trained here for a target (``drafter = "head"``, ``head = "FOLDER"``; issue #41 item 2).

The same shape as a checkpoint's own MTP layer (``runner.drafting.mtp``), with weights trained here by
``models/train_drafter.py``: at position i it takes the target's last hidden state h_i and the embedding of token
i+1 (the target's own embedding), normalises each, concatenates them (embedding first), projects them back to the
target's width, runs one decoder layer of the target's own architecture (mlx-lm's class: llama's for SmolLM2 and the
default pair's target, gemma3_text's for Gemma 3, built as a full-attention layer; trained from random weights), a
norm and the target's LM head: the draft for token i+2. ``runner.drafting.mtp.MTPDrafter`` drives it exactly as it
drives an MTP layer (the target called as ``HiddenModel``; chained steps on its own output; its cache holds kept
positions only).

A head may carry a reduced vocabulary (EAGLE-3's): the N tokens the target chose most often in its training data
(``d2t``, draft index -> target token) and the target's LM-head rows for them, so a draft step multiplies by
N x width, not vocab x width. Its drafts are then always among those N tokens; its logits go back to the target's
vocabulary (every other token at -inf) so sampling and verification are unchanged.

The folder: ``config.json`` (the layer's shape as a model config, so the memory estimate reads it as any model's,
and under ``"drafter_head"`` what it was trained for: the target's folder, its config's sha256, vocabulary size,
width and model type, and how it was trained) and ``model.safetensors`` (float16). ``common.heads`` checks a
head against a target without MLX (the settings' check); ``load_head`` builds it.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from common.heads import mismatch, read_head_config

from .drafters import to_full_vocabulary
from .mtp import MTPDrafter, _text_model


def full_attention_index(model) -> int:
    """The last layer of ``model`` whose cache is a plain KVCache (not a sliding window's), else the last layer."""
    caches = make_prompt_cache(model)
    full = [i for i, c in enumerate(caches) if type(c) is KVCache]
    return full[-1] if full else len(caches) - 1


def make_layer(model, index: int):
    """A decoder layer of ``model``'s own class, built as its layer ``index`` would be (Gemma 3's decides sliding or
    global by its index; llama's second argument is not an index)."""
    text = _text_model(model)
    layer_class = type(text.model.layers[index])
    parameters = list(inspect.signature(layer_class.__init__).parameters)[2:]
    if parameters and parameters[0] in ("layer_idx", "layer_index", "idx", "layer_id"):
        return layer_class(text.args, index)
    return layer_class(text.args)


class EagleHead(nn.Module):
    """``enorm``, ``hnorm``, ``fc``, ``layers.0`` (the target's decoder-layer class), ``norm``; with a reduced
    vocabulary, ``lm_head`` (its rows of the target's head) and ``d2t``."""

    def __init__(self, model, index: int, draft_vocab: int = 0):
        super().__init__()
        args = _text_model(model).args
        hidden, eps = args.hidden_size, getattr(args, "rms_norm_eps", 1e-6)
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = [make_layer(model, index)]
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.vocab_size = int(args.vocab_size)
        if draft_vocab:
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
            self.d2t = mx.zeros((draft_vocab,), dtype=mx.int32)

    def project(self, embedded, hidden):
        return self.fc(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))

    def decode(self, x, cache, mask=None):
        if mask is None:
            mask = create_attention_mask(x, cache)
        return self.layers[0](x, mask, cache)

    def final_norm(self, x):
        return self.norm(x)

    @property
    def reduced(self) -> bool:
        return "lm_head" in self

    def draft_head(self, target_head):
        """What turns the layer's normed output into logits over the target's vocabulary: the target's own head,
        or the reduced one scattered back (every token outside it at -inf)."""
        if not self.reduced:
            return target_head
        return lambda x: to_full_vocabulary(self.lm_head(x), self.d2t, self.vocab_size)


def trainable_keys(head: EagleHead) -> list[str]:
    """What training changes: everything but the reduced head's rows and map (copies of the target's)."""
    from mlx.utils import tree_flatten

    return [k for k, _ in tree_flatten(head.parameters()) if not k.startswith(("lm_head.", "d2t"))]


def build_head(model, draft_tokens: list[int] | None = None, copy_layer: bool = True) -> EagleHead:
    """A new head for ``model`` (float32): its layer a copy of the target's last full-attention layer, its norms at
    one, ``fc`` random; with ``draft_tokens`` a reduced vocabulary of those target tokens."""
    index = full_attention_index(_text_model(model))
    head = EagleHead(model, index, len(draft_tokens) if draft_tokens else 0)
    text = _text_model(model)
    from mlx.utils import tree_flatten

    if copy_layer:
        head.layers[0].update(text.model.layers[index].parameters())
    # The final norm starts as the target's (its effective weight: the norm of a vector of ones), so the head's
    # logits start at the target's scale.
    head.norm.weight = text.model.norm(mx.ones((1, head.norm.weight.size))).reshape(-1)
    if draft_tokens:
        head.d2t = mx.array(draft_tokens, dtype=mx.int32)
        head.lm_head.weight = _head_rows(model, head.d2t)
    head.set_dtype(mx.float32)
    mx.eval(head.parameters())
    assert all(v.dtype in (mx.float32, mx.int32) for _, v in tree_flatten(head.parameters()))
    return head


def _head_rows(model, tokens: mx.array) -> mx.array:
    """The target's LM-head rows of ``tokens`` (dequantized)."""
    text = _text_model(model)
    if getattr(text.args, "tie_word_embeddings", False) or not hasattr(text, "lm_head"):
        return text.model.embed_tokens(tokens).astype(mx.float32)
    head = text.lm_head
    if hasattr(head, "scales"):
        weight = mx.dequantize(head.weight, head.scales, getattr(head, "biases", None), head.group_size, head.bits)
    else:
        weight = head.weight
    return weight[tokens].astype(mx.float32)


def save_head(head: EagleHead, folder: Path, config: dict) -> None:
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: (v if v.dtype == mx.int32 else v.astype(mx.float16)) for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_head(folder: str | Path, target) -> EagleHead:
    """The head in ``folder`` for ``target`` (a runner.loading.load.LoadedModel), in the target's float dtype; raises
    ValueError naming the mismatch where it was trained for another target."""
    folder = Path(folder)
    config = read_head_config(folder)
    problem = mismatch(config, target.config)
    if problem:
        raise ValueError(problem)
    trained = config["drafter_head"]
    weights = mx.load(str(folder / "model.safetensors"))
    head = EagleHead(target.model, int(trained["layer_index"]), int(trained.get("draft_vocab") or 0))
    head.load_weights(list(weights.items()), strict=True)
    head.set_dtype(_text_model(target.model).model.norm.weight.dtype)  # floats only: d2t stays int32
    if target.padded_layers:  # the target's one-row products run as two rows (runner.loading.row_padding): so do its
        from ..loading.row_padding import pad_single_rows

        pad_single_rows(head)
    mx.eval(head.parameters())
    return head


class HeadDrafter(MTPDrafter):
    """Drafts with a trained head exactly as ``MTPDrafter`` does with an MTP layer; its logits through the head's
    own (reduced) vocabulary where it has one."""

    name = "head"

    def __init__(self, model, head: EagleHead, cache=None, held: int = 0):
        super().__init__(model, head, cache, held)
        self.head = head.draft_head(self.head)
