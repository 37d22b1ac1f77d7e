"""A model's own multi-token-prediction (MTP) layers as the drafter (``drafter = "mtp"``).

Some checkpoints carry MTP layers trained with the model: DeepSeek-V3 / GLM-4.5
style (``model.layers.N`` for N >= ``num_hidden_layers``, config
``num_nextn_predict_layers``) and Qwen3.5 / Qwen3-Next style (``mtp.*``, config
``mtp_num_hidden_layers``). mlx-lm's ``sanitize`` drops them; ``load_mtp``
reads them from the checkpoint's safetensors and builds the first one with
mlx-lm's own decoder-layer class.

An MTP layer at position i takes the target's hidden state h_i and the
embedding of token i+1, normalises each, concatenates them (embedding first) and
projects them back to the model's width, runs one decoder layer (with its own KV
cache over the positions it has seen), a norm and the target's LM head: the
draft for token i+2. Deeper drafts chain it on its own output hidden state and
its own last draft.

The hidden states: a request drafting with MTP calls the target through
``HiddenModel`` - the target's inner model, then its LM head, which is what
mlx-lm's own ``__call__`` does - and keeps the inner model's output (after its
final norm: what vLLM and SGLang hand their MTP layers) by position. Plain
decoding is untouched. The ``MTPDrafter`` feeds its layer the pairs (h_i, token
i+1) of every position the target has kept, then drafts; the chained steps it
adds for deeper drafts are trimmed off its cache at once (they rest on its own
hidden states, not the target's), so rejected drafts never need rewinding there.
Positions the target ran without it (a prompt-cache hit's prefix, batched rounds)
are missing from its cache: it drafts on what it saw, and verification stays the
target's, so the output is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from common.footprint import mtp_layers, text_config

from ..prompt_cache import trimmed_copy
from ..sampling import SamplingParams
from . import drafters
from .drafters import HiddenStateDrafter, Proposal, draft_token, tokens_after_verification


def _text_model(model):
    """mlx-lm's text model inside ``model`` (Qwen3.5's ``language_model``), which has ``.model`` and a head."""
    return getattr(model, "language_model", model)


def lm_head(model):
    text = _text_model(model)
    args = text.args
    if getattr(args, "tie_word_embeddings", False) or not hasattr(text, "lm_head"):
        return text.model.embed_tokens.as_linear
    return text.lm_head


def _checkpoint_tensors(folder: Path, keep) -> dict:
    """The tensors whose names ``keep`` takes, from the shards that hold them (the index says which)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("model*.safetensors"))
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for k, f in names.items() if keep(k)})
    tensors = {}
    for file in files:
        tensors.update({k: v for k, v in mx.load(str(file)).items() if keep(k)})
    return tensors


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's MTP module: ``enorm``, ``hnorm``, ``eh_proj``, the decoder layer's own weights at its level,
    ``shared_head.norm`` (the head itself and ``embed_tokens`` are copies of the target's: the target's are used)."""

    def __init__(self, layer_class, args, index: int):
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer_class(args, index)
        self.shared_head = _NormHolder(hidden, eps)

    def project(self, embedded, hidden):
        return self.eh_proj(mx.concatenate([self.enorm(embedded), self.hnorm(hidden)], axis=-1))

    def decode(self, x, cache):
        mask = create_attention_mask(x, cache, return_array=True)
        return self.layer(x, mask, cache)

    def final_norm(self, x):
        return self.shared_head.norm(x)


class _NormHolder(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps)


class QwenMTP(nn.Module):
    """Qwen3-Next / Qwen3.5's ``mtp``: ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``, ``fc``, ``layers.0`` (a
    full-attention decoder layer) and ``norm``."""

    def __init__(self, layer_class, args):
        super().__init__()
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        # A full-attention layer: mlx-lm's class decides by its index (every full_attention_interval-th attends).
        self.layers = [layer_class(args, args.full_attention_interval - 1)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def project(self, embedded, hidden):
        return self.fc(mx.concatenate([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], -1))

    def decode(self, x, cache):
        mask = create_attention_mask(x, cache)
        return self.layers[0](x, mask, cache)

    def final_norm(self, x):
        return self.norm(x)


def load_mtp(folder: Path, model, config: dict, dtype: str):
    """The checkpoint's first MTP layer as a module over ``model`` (an mlx-lm target), or None when it has none.
    A quantized checkpoint's MTP layer is not read (None)."""
    count = mtp_layers(config)
    if not count or config.get("quantization") or config.get("quantization_config"):
        return None
    folder = Path(folder)
    text = _text_model(model)
    args = text.args
    if "mtp_num_hidden_layers" in text_config(config):
        tensors = _checkpoint_tensors(folder, lambda k: k.startswith("mtp.") or ".mtp." in k)
        weights = {k[k.index("mtp.") + 4 :]: v for k, v in tensors.items()}
        if not weights:
            return None
        unsanitized = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in _conv_probe(folder).items())
        if unsanitized:  # Hugging Face's zero-centred norms: mlx-lm's sanitize adds 1 to the model's own
            weights = {k: (v + 1.0 if "norm" in k and v.ndim == 1 else v) for k, v in weights.items()}
        mtp = QwenMTP(type(text.model.layers[-1]), args)
    else:
        index = int(args.num_hidden_layers)
        prefix = f"model.layers.{index}."
        tensors = _checkpoint_tensors(folder, lambda k: k.startswith(prefix))
        if not tensors:
            return None
        # The target class's own sanitize (MLA's kv_b_proj split, experts stacked) on the layer renamed to index 0.
        renamed = {"model.layers.0." + k[len(prefix) :]: v for k, v in tensors.items()}
        sanitized = type(model).sanitize(SimpleNamespace(args=args), renamed)
        weights = {}
        extras = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
        for key, value in sanitized.items():
            name = key[len("model.layers.0.") :]
            if name.startswith(("embed_tokens.", "shared_head.head.")):
                continue  # copies of the target's
            weights[name if name.startswith(extras) else "layer." + name] = value
        # The target's own layer class (deepseek_v3's, glm4_moe's), built for index N: dense or MoE as its config says.
        mtp = DeepseekMTP(type(text.model.layers[-1]), args, index)
    mtp.load_weights(list(weights.items()), strict=True)
    if dtype == "float32":
        mtp.set_dtype(mx.float32)
    else:
        mtp.set_dtype(_text_model(model).model.embed_tokens.weight.dtype)
    mx.eval(mtp.parameters())
    return mtp


def _conv_probe(folder: Path) -> dict:
    """The checkpoint's conv1d weights' shapes (whether it is Hugging Face's layout, as mlx-lm's sanitize tells)."""
    index = folder / "model.safetensors.index.json"
    files = sorted(folder.glob("model*.safetensors"))
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for k, f in names.items() if k.endswith("conv1d.weight")})[:1]
    for file in files:
        found = {k: v for k, v in mx.load(str(file)).items() if k.endswith("conv1d.weight")}
        if found:
            return dict(list(found.items())[:1])
    return {}


def drop_mtp_layers(model_class, config: dict):
    """A ``sanitize`` for ``model_class`` that also drops the MTP layers past ``num_hidden_layers`` (mlx-lm's
    deepseek_v3 drops only layer 61, DeepSeek-V3's own), or None where the class needs no help."""
    original = getattr(model_class, "sanitize", None)
    args = text_config(config)
    if original is None or not args.get("num_nextn_predict_layers"):
        return None
    first = int(args["num_hidden_layers"])

    def sanitize(self, weights):
        weights = {
            k: v for k, v in weights.items() if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= first)
        }
        return original(self, weights)

    return sanitize


class HiddenModel:
    """The target as an MTP request calls it: logits as mlx-lm computes them, its inner model's output kept by
    position in ``sink`` (the drafter's ``hidden``)."""

    def __init__(self, model, sink: dict):
        self.target = model
        self.text = _text_model(model)
        self.head = lm_head(model)
        self.sink = sink

    @property
    def layers(self):
        return self.target.layers

    def make_cache(self):
        return make_prompt_cache(self.target)

    def __getattr__(self, name):
        return getattr(self.target, name)

    def __call__(self, inputs, cache=None, **kwargs):
        start = _offset(cache)
        hidden = self.text.model(inputs, cache, **kwargs)
        if start is not None and hidden.shape[0] == 1:
            for i in range(hidden.shape[1]):
                self.sink[start + i] = hidden[:, i : i + 1]
        return self.head(hidden)


def _offset(cache) -> int | None:
    from ..rewind import leaves

    for layer in leaves(cache or []):
        offset = getattr(layer, "offset", None)
        if isinstance(offset, int):
            return offset
    return None


class MTPDrafter(HiddenStateDrafter):
    """Drafts with the target's MTP layer (see the module's docstring)."""

    name = "mtp"

    def __init__(self, model, mtp, cache: KVCache | None = None, held: int = 0):
        """``cache`` and ``held``: a layer state the prompt cache kept (``layer_state``), holding the pairs of the
        first ``held`` positions."""
        self.text = _text_model(model)
        self.embed = self.text.model.embed_tokens
        self.head = lm_head(model)
        self.mtp = mtp
        self.cache = cache if cache is not None else KVCache()
        self.hidden: dict[int, mx.array] = {}  # target position -> its hidden state (1, 1, width)
        self.held = held  # context positions its cache covers: pairs (h_i, token i+1) for i < held
        self.whole = True  # its cache holds a pair for every position before ``held`` (none was missing)
        # The next round's first draft for every outcome of a verification not read yet (``queue_next``): the
        # verified round's first position, its depth, the layer's output rows, their drafts and q rows.
        self._queued: tuple | None = None
        # That outcome's, once known (``accepted``): the position it drafts after, its draft, the layer's output
        # row it chains on, its q row (None: greedy).
        self._next: tuple | None = None

    def layer_state(self, tokens: int) -> KVCache | None:
        """For the prompt cache's entry of the context's first ``tokens`` tokens: a copy of its cache holding the
        pairs that lie within them (positions before ``tokens`` - 1), or None where positions are missing from it
        (a prompt-cache hit's prefix it was not given, batched rounds): its cache's entries are then no longer
        its positions."""
        pairs = min(self.held, tokens - 1)
        if not self.whole or pairs <= 0:
            return None
        return trimmed_copy([self.cache], pairs)[0]

    def propose(self, context: list[int], k: int, params: SamplingParams, key) -> Proposal | None:
        if k <= 0:
            return None
        last = len(context) - 1  # the pending token's position: h_last is not known yet
        queued, self._next = self._next, None
        step_keys = mx.random.split(key, k) if key is not None else [None] * k
        tokens, probs = [], []
        if queued is not None and queued[0] == last == self.held:  # its first draft, queued with the verification
            _, token, hidden, q = queued
            tokens.append(token)
            probs += [q] if q is not None else []
            following, step_keys = token.reshape(1, 1), step_keys[1:]
        else:
            positions = [i for i in range(self.held, last) if i in self.hidden]
            if not positions:
                return None  # nothing of the target's to draft from (yet)
            if positions != list(range(self.held, last)):
                self.whole = False
            hidden = mx.concatenate([self.hidden[i] for i in positions], axis=1)
            following = mx.array([context[i + 1] for i in positions])[None]
            for i in [i for i in self.hidden if i < last]:  # in place: the target's HiddenModel writes here
                del self.hidden[i]
            self.held = last
        for step_key in step_keys:
            x = self.mtp.decode(self.mtp.project(self.embed(following), hidden), self.cache)
            hidden = x[:, -1:]
            logits = self.head(self.mtp.final_norm(hidden))[0, -1]
            token = draft_token(logits, params, step_key, probs)
            mx.async_eval(token)
            tokens.append(token)
            following = token.reshape(1, 1)
        if k > 1:
            self.cache.trim(k - 1)  # the chained steps rest on its own hidden states: the next round feeds the target's
        return Proposal(mx.stack(tokens).astype(mx.uint32), mx.stack(probs) if probs else None)

    def queue_next(self, context: list[int], drafts: mx.array, verdict, params: SamplingParams, key) -> None:
        """The verification of ``drafts`` fed the target positions last..last + k (the pending token and the
        drafts): whatever it keeps (a of them), the next round's first draft comes from the pairs of positions
        last..last + a, which are (h_i, the token fed after i) up to the kept drafts and (h_last+a, the target's
        own token) at the end. Row j of one pass of the layer over (h_last+j, x_j), where x_j is draft j + 1, or the
        verdict's token where j = a (lazy, an ``mx.where``), is that draft for the outcome a = j: causal attention
        keeps row j from seeing rows after it. ``accepted`` trims the rows past a off its cache."""
        last, k = len(context) - 1, drafts.size
        rows = range(last, last + k + 1)
        if not drafters.QUEUE_NEXT_DRAFT or self.held != last or any(i not in self.hidden for i in rows):
            return
        hidden = mx.concatenate([self.hidden.pop(i) for i in rows], axis=1)
        following = tokens_after_verification(drafts, verdict)[None]
        x = self.mtp.decode(self.mtp.project(self.embed(following), hidden), self.cache)
        probs: list = []
        tokens = draft_token(self.head(self.mtp.final_norm(x))[0], params, key, probs)
        mx.async_eval(tokens)
        self._queued = (last, k, x, tokens, probs[0] if probs else None)

    def accepted(self, proposal: Proposal, accepted: int) -> None:
        """With a first draft queued (``queue_next``): keep the pairs of the positions the target kept, and the
        draft that follows them."""
        queued, self._queued = self._queued, None
        if queued is None:
            return
        last, k, x, tokens, q = queued
        self.cache.trim(k - accepted)
        self.held = last + accepted + 1
        self._next = (self.held, tokens[accepted], x[:, accepted : accepted + 1], None if q is None else q[accepted])
