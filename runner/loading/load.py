"""Loading one mlx-lm model folder: any architecture mlx-lm knows, in the dtype the device wants.

``dtype`` is resolved once per runner (``common.footprint.resolve_dtype``):
- ``checkpoint`` keeps the folder's form: quantized layers stay quantized,
  bfloat16/float16 stays as stored;
- ``float32`` dequantizes quantized layers (``mx.dequantize`` into plain
  ``Linear``/``Embedding``) and casts every float parameter to float32;
- ``auto`` is the checkpoint's form on a GPU, float32 on the CPU (measured
  here on SmolLM2: 4-bit prefills at 9 tok/s and decodes at 6, float32 at 169
  and 18) unless the float32 copy would not fit in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from mlx_lm.utils import dequantize_model, get_total_parameters

from common.errors import ModelLoadError
from common.footprint import context_length

from ..rewind import rewindable
from .attention import applies as plain_attention_applies
from .attention import use_plain_attention
from .fusion import fuse as fuse_projections
from .row_padding import applies as row_padding_applies
from .row_padding import decide as decide_row_padding
from .row_padding import pad_single_rows


@dataclass
class LoadedModel:
    path: Path
    model: object
    tokenizer: object
    config: dict
    dtype: str  # the resolved setting: "checkpoint" or "float32"
    parameters: int  # true count (quantized weights unpacked)
    max_context: int | None = None  # a per-model limit below the config's
    padded_layers: int = 0  # layers that run one-row inputs as two rows (runner.loading.row_padding)
    plain_attention: int = 0  # model modules whose small attentions run as plain ops (runner.loading.attention)
    vision: object = None  # a model that sees: its runner.vision.Vision (model is then its language model)
    row_padding: str = ""  # whether one-row products run as two rows, and why (runner.loading.row_padding)
    mtp: object = None  # its own multi-token-prediction layer (runner.drafting.mtp), where the checkpoint has one
    fused_groups: int = 0  # projections that read one input, stacked into one product (runner.loading.fusion)
    fusion: str = ""  # whether they are, and why (runner.loading.fusion)

    @property
    def quantization(self) -> dict | None:
        """The checkpoint's quantization (bits, group size), whatever form it is computed in."""
        q = self.config.get("quantization") or self.config.get("quantization_config")
        return q if isinstance(q, dict) and "bits" in q else None

    @property
    def is_quantized(self) -> bool:
        """Quantized layers are in use (checkpoint form of a quantized folder)."""
        return self.quantization is not None and self.dtype == "checkpoint"

    @property
    def compute_dtype(self) -> str:
        """What the layers compute in, in words: "float32", "bfloat16", "4-bit (group 64)", ..."""
        if self.is_quantized:
            q = self.quantization
            return f"{q['bits']}-bit affine (group {q.get('group_size', 64)})"
        return _dtype_name(self.model)

    @property
    def context_length(self) -> int:
        length = context_length(self.config)
        return min(length, self.max_context) if self.max_context else length

    @property
    def vocab_size(self) -> int:
        args = self.model.args
        size = getattr(args, "vocab_size", None) or getattr(
            getattr(args, "text_config", None) or {}, "get", lambda *_: None
        )("vocab_size")
        return int(size or len(self.tokenizer.get_vocab()))

    @property
    def rewindable(self) -> bool:
        """Its caches can be taken back past rejected drafts (speculative decoding needs it): trimmed,
        or restored and fed again (``runner.rewind``)."""
        return rewindable(make_prompt_cache(self.model))

    @property
    def sliding_window(self) -> int:
        """Tokens its sliding-window layers (mlx-lm's ``RotatingKVCache``) attend to; 0 where none slide."""
        windows = [c.max_size for c in make_prompt_cache(self.model) if isinstance(c, RotatingKVCache)]
        return max(windows, default=0)

    @property
    def sliding_layers(self) -> int:
        return sum(isinstance(c, RotatingKVCache) for c in make_prompt_cache(self.model))

    def cache_description(self) -> str:
        kinds = sorted({type(c).__name__ for c in make_prompt_cache(self.model)})
        return ", ".join(kinds)


def _dtype_name(model) -> str:
    from mlx.utils import tree_flatten

    widths = {}
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            widths[value.dtype] = widths.get(value.dtype, 0) + value.size
    if not widths:
        return "unknown"
    return str(max(widths, key=widths.get)).removeprefix("mlx.core.")


def identity(path: Path, dtype: str) -> str:
    """A model as loaded: its folder, its config (as it is now) and the dtype."""
    config = path / "config.json"
    return f"{path.resolve()}|{config.stat().st_mtime_ns}|{config.stat().st_size}|{dtype}"


def load_model(
    folder: str | Path,
    dtype: str,
    max_context: int | None = None,
    row_padding: bool | None = None,
    group=None,
    fuse: bool = True,
) -> LoadedModel:
    """Load one mlx-lm folder in ``dtype`` ("checkpoint" or "float32"); every failure is a ModelLoadError.

    ``row_padding``: run one-row products as two rows (``runner.loading.row_padding``); None = where it is faster,
    measured on this model as it loads.
    ``group``: a ``runner.group.Group``: keep this rank's share of the weights (mlx-lm's ``shard``, or its run
    of layers for a pipeline: ``runner.pipeline``), before any layer is wrapped.
    ``fuse``: stack the projections that read one input into one product where the logits stay the same
    (``runner.loading.fusion``; a group's ranks are left apart: checking would need the whole group's pass)."""
    from mlx_lm.utils import load as mlx_lm_load

    path = Path(folder)
    if not path.is_dir():
        raise ModelLoadError(path, "no such folder")
    if not (path / "config.json").is_file():
        raise ModelLoadError(path, "config.json is missing")
    vision = None
    try:
        from ..vision import is_vision

        if is_vision(path):  # a vision-language checkpoint: mlx-vlm's, decoded by mlx-lm's language model class
            from ..vision import load as load_vision

            model, tokenizer, config, vision = load_vision(path, dtype)
        else:
            model, tokenizer, config = _load_text(path, mlx_lm_load)
        # transformers warns of "indexing errors" when a text tokenizes past model_max_length; the runner checks
        # each prompt against the context itself (a prompt too long is refused, or only counted), so say nothing.
        hf_tokenizer = getattr(tokenizer, "_tokenizer", None)
        if hf_tokenizer is not None and hasattr(hf_tokenizer, "model_max_length"):
            hf_tokenizer.model_max_length = 2**62
        parameters = get_total_parameters(vision.model if vision is not None else model)
        if dtype == "float32":
            dequantize_model(model)
            model.set_dtype(mx.float32)
        mx.eval(model.parameters())
        if group is not None and group.mode == "pipeline":
            from ..pipeline import pipeline

            pipeline(model, group.group)
            mx.eval(model.parameters())
        elif group is not None:
            model.shard(group.group)
            mx.eval(model.parameters())
        mx.clear_cache()
        if not fuse:
            fused, fusion = 0, "off: asked"
        elif group is not None:
            fused, fusion = 0, "off: a group's ranks"
        else:
            fused, fusion = fuse_projections(model)
        plain = use_plain_attention(model) if plain_attention_applies() else 0
        if row_padding is None and group is None:  # measured here, on this model (runner.loading.row_padding)
            padded, padding = decide_row_padding(model, identity(path, dtype) + ("|fused" if fused else ""))
        elif row_padding is None:  # a group's ranks must agree: the device's rule
            padded = pad_single_rows(model) if row_padding_applies() else 0
            padding = f"{'on' if padded else 'off'}: a group's rule (the CPU with MKL)"
        else:
            padded = pad_single_rows(model) if row_padding else 0
            padding = f"{'on' if row_padding else 'off'}: asked"
        mtp = None
        if vision is None and group is None:
            from ..drafting.mtp import load_mtp

            mtp = load_mtp(path, model, config, dtype)
    except Exception as error:  # noqa: BLE001 - any cause is reported with the folder
        raise ModelLoadError(path, f"{type(error).__name__}: {error}") from error
    return LoadedModel(
        path,
        model,
        tokenizer,
        config,
        dtype,
        parameters,
        max_context,
        padded,
        plain,
        vision,
        padding,
        mtp,
        fused,
        fusion,
    )


def _load_text(path: Path, mlx_lm_load):
    """mlx-lm's load; a checkpoint with MTP layers past ``num_hidden_layers`` (DeepSeek-V3 style) with them left
    out of the target (mlx-lm's deepseek_v3 drops only DeepSeek-V3's own layer 61; runner.drafting.mtp reads them)."""
    import json

    from mlx_lm.utils import _get_classes

    from ..drafting.mtp import drop_mtp_layers

    config = json.loads((path / "config.json").read_text())
    try:
        model_class, _ = _get_classes(config)
    except Exception:  # noqa: BLE001 - mlx-lm's load reports an unknown architecture itself
        model_class = None
    sanitize = drop_mtp_layers(model_class, config) if model_class is not None else None
    if sanitize is None:
        return mlx_lm_load(str(path), return_config=True)
    original = model_class.sanitize
    model_class.sanitize = sanitize
    try:
        return mlx_lm_load(str(path), return_config=True)
    finally:
        model_class.sanitize = original
