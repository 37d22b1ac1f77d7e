"""How much memory a model will take, worked out from its folder before anything is loaded.

Importable without MLX: the supervisor uses it for its admission check and
shows it beside the measured RSS; the runner uses it to decide whether a
float32 copy of a quantized model fits (``dtype = "auto"`` on the CPU).

The estimate of a runner is the sum of
- the weights as they will sit in memory: quantized stays quantized (the packed
  words plus scales and biases, as stored), a dtype cast counted at the new width;
- the KV caches of target and draft for the whole context
  (layers x KV heads x head dim x 2 x bytes per value x tokens);
- the prefill's transient attention scores: on the CPU, MLX materialises a
  (heads x chunk x context) float32 matrix, and the engine sizes prefill chunks
  to keep it under ``DEFAULT_PREFILL_SCORE_BYTES`` (twice that is counted: the
  scores and their softmax);
- a model that sees: the vision tower's transient while it encodes the largest request the image settings allow
  (``max_images`` images at the most pixels the model sees, ``image_pixels`` or its processor's own cap): its
  activations (``VISION_ACTIVATIONS`` x patches x width values, measured) and, on the CPU, one attention's
  score matrix (heads x span x span float32: a dynamic-resolution tower attends within each image, one at a
  time; a fixed-size tower attends within each tile, all tiles in one batch);
- the runtime: the interpreter, MLX, gRPC and the tokenizer, measured as the
  runner's RSS before it loads anything (reported in Info; ``RUNTIME_OVERHEAD``
  until a runner has reported it), plus the glibc and MLX pool slack seen
  around the weights (``LOAD_SLACK`` of the weights).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import re
import struct
import sys
from dataclasses import dataclass
from importlib import metadata as package_metadata
from pathlib import Path

from .defaults import CPU_PREFILL_CHUNK, DEFAULT_PREFILL_SCORE_BYTES, MIN_PREFILL_CHUNK

# Measured here (2 cores, x86_64, MLX 0.32 on the CPU with MKL): a runner's RSS before it loads
# its models is 88-95 MiB; the rest of this figure is what gRPC's threads and the first allocations
# add while serving.
RUNTIME_OVERHEAD = 150 * 2**20
LOAD_SLACK = 0.15  # measured: RSS after load exceeds MLX's active bytes by ~10-20% of the weights
SAFETENSORS_ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# A vision tower's peak activations while it encodes, in values per patch per unit of its width: measured on a
# Qwen2-VL tower (width 1280, 16 heads, float32 on this CPU: 200 MiB past its weights for 1024 patches, 638 MiB
# for 2304, fitted as the score matrix plus 27 x patches x width x 4 bytes), rounded up.
VISION_ACTIVATIONS = 32
DEFAULT_IMAGE_PIXELS = 1024 * 1024  # the most pixels of an image the model sees (settings.image_pixels)
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx", "n_positions")
DEFAULT_CONTEXT = 2048


class FootprintError(ValueError):
    """The folder cannot be read well enough to estimate it."""


def read_safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FootprintError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > 100 * 2**20:
            raise FootprintError(f"{path}: implausible safetensors header of {length} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise FootprintError(f"{path}: not a safetensors file") from None
    header.pop("__metadata__", None)
    return header


def model_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise FootprintError(f"{folder}/config.json: {error}") from None
    return config


def text_config(config: dict) -> dict:
    """Multimodal configs keep the language model's sizes under text_config."""
    return {**config, **config.get("text_config", {})}


def mtp_layers(config: dict) -> int:
    """How many MTP layers a checkpoint's config declares (DeepSeek-V3/GLM's, Qwen3.5's names; 0: none)."""
    args = text_config(config)
    return int(args.get("num_nextn_predict_layers") or args.get("mtp_num_hidden_layers") or 0)


def context_length(config: dict) -> int:
    config = text_config(config)
    for key in CONTEXT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return DEFAULT_CONTEXT


@dataclass(frozen=True)
class VisionFootprint:
    """A vision tower's sizes, from ``vision_config`` and the processor's configuration."""

    width: int  # the tower's hidden size
    heads: int
    patch: int
    image_size: int = 0  # a fixed-size tower's side (0: dynamic resolution, as Qwen-VL's and Pixtral's)
    tiles: int = 1  # a fixed-size tower: the crops of one image the processor makes at most (and the whole)
    max_pixels: int = 0  # dynamic resolution: the processor's own cap on an image's pixels (0: none)

    @classmethod
    def of(cls, config: dict, preprocessor: dict | None) -> VisionFootprint | None:
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return None
        pre = preprocessor or {}
        width = int(vision.get("embed_dim") or vision.get("hidden_size") or 0)  # Qwen2-VL's hidden_size is its merger's
        heads = int(vision.get("num_heads") or vision.get("num_attention_heads") or 1)
        patch = vision.get("patch_size") or 14
        patch = int(patch.get("height", 14) if isinstance(patch, dict) else patch)
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        if any(key in pre for key in ("max_pixels", "merge_size", "temporal_patch_size")):  # Qwen-VL's processors
            cap = pre.get("max_pixels") or size.get("longest_edge") or 0  # a count of pixels there
            return cls(width, heads, patch, max_pixels=int(cap))
        if "Pixtral" in str(pre.get("image_processor_type", "")):  # longest_edge is a side there
            return cls(width, heads, patch, max_pixels=int(size.get("longest_edge") or 0) ** 2)
        image_size = int(vision.get("image_size") or 0)
        tiles = 1
        crop = pre.get("max_image_size") if isinstance(pre.get("max_image_size"), dict) else {}
        crop = crop.get("longest_edge")
        if pre.get("do_image_splitting") and crop and size.get("longest_edge"):  # Idefics3 / SmolVLM: crops + whole
            tiles = -((-int(size["longest_edge"]) // int(crop)) ** 2) + 1
        return cls(width, heads, patch, image_size=image_size, tiles=tiles)

    def transient(self, images: int, pixels: int, device: str, itemsize: int) -> int:
        """Bytes the tower's encode of ``images`` images of at most ``pixels`` pixels takes past its weights."""
        if self.image_size:
            span = (self.image_size // self.patch) ** 2
            total, batch = images * self.tiles * span, images * self.tiles
        else:
            seen = min(pixels, self.max_pixels) if self.max_pixels else pixels
            span = max(1, seen // (self.patch * self.patch))
            total, batch = images * span, 1
        activations = VISION_ACTIVATIONS * total * self.width * itemsize
        scores = 4 * batch * self.heads * span * span if device == "cpu" else 0
        return activations + scores


def preprocessor_config(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "preprocessor_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass(frozen=True)
class ModelFootprint:
    """What a model folder holds, in the numbers the estimate needs."""

    path: Path
    parameters: int  # true count: quantized weights counted unpacked
    checkpoint_bytes: int  # weights as stored (and as loaded with dtype "checkpoint")
    float32_bytes: int  # weights dequantized and cast to float32
    quantization: dict | None  # config's {"bits", "group_size", ...}
    checkpoint_dtype: str  # the widest float dtype stored ("float16", "bfloat16", "float32")
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    context_length: int
    # Weights outside the layer stack (embeddings, final norm, head): whole on every rank of a group.
    unsplit_checkpoint_bytes: int = 0
    unsplit_float32_bytes: int = 0
    vision: VisionFootprint | None = None  # a model that sees
    kind: str = "generate"  # or "embed", "rerank" (common.embedding.model_kind): no KV cache, a batch's transient
    # multi-token-prediction layers the checkpoint carries (runner.drafting.mtp drafts with the first)
    mtp_layers: int = 0

    @classmethod
    def of(cls, folder: str | Path) -> ModelFootprint:
        folder = Path(folder)
        config = model_config(folder)
        files = sorted(folder.glob("model*.safetensors"))
        if not files:
            raise FootprintError(f"{folder}: no model*.safetensors")
        tensors = {}
        for file in files:
            tensors.update(read_safetensors_header(file))
        from .embedding import model_kind

        footprint = cls.from_parts(folder, config, tensors, preprocessor_config(folder))
        return dataclasses.replace(footprint, kind=model_kind(folder))

    @classmethod
    def from_parts(cls, folder: Path, config: dict, tensors: dict, preprocessor: dict | None = None) -> ModelFootprint:
        """From a config and the weights' safetensors header entries (read from files, or from a hub's byte
        ranges before the weights come: supervisor.hub)."""
        quantization = config.get("quantization") or config.get("quantization_config")
        if not isinstance(quantization, dict) or "bits" not in quantization:
            quantization = None
        parameters, checkpoint, float32, float_widths = _weigh(tensors, quantization)
        outside = {name: info for name, info in tensors.items() if not _LAYER.search(name)}
        _, unsplit_checkpoint, unsplit_float32, _ = _weigh(outside, quantization, tensors)
        args = text_config(config)
        heads = int(args.get("num_attention_heads") or args.get("n_head") or 1)
        hidden = int(args.get("hidden_size") or args.get("d_model") or 0)
        head_dim = int(args.get("head_dim") or (hidden // heads if hidden else 64))
        if "F32" in float_widths or {"F16", "BF16"} <= float_widths:
            widest = "float32"  # float16 with bfloat16 (or float32) promotes to float32 in MLX
        else:
            widest = FLOAT_DTYPES[next(iter(float_widths))] if float_widths else "float32"
        return cls(
            path=folder,
            parameters=parameters,
            checkpoint_bytes=checkpoint,
            float32_bytes=float32,
            quantization=quantization,
            checkpoint_dtype=widest,
            layers=int(args.get("num_hidden_layers") or args.get("n_layer") or 0),
            kv_heads=int(args.get("num_key_value_heads") or heads),
            heads=heads,
            head_dim=head_dim,
            context_length=context_length(config),
            unsplit_checkpoint_bytes=unsplit_checkpoint,
            unsplit_float32_bytes=unsplit_float32,
            vision=VisionFootprint.of(config, preprocessor),
            mtp_layers=mtp_layers(config),
        )

    def weight_bytes(self, dtype: str) -> int:
        """Weights in memory for a resolved dtype, "checkpoint" or "float32"."""
        return self.float32_bytes if dtype == "float32" else self.checkpoint_bytes

    def unsplit_bytes(self, dtype: str) -> int:
        """Weights every rank of a group holds whole (outside the layers) for a resolved dtype."""
        return self.unsplit_float32_bytes if dtype == "float32" else self.unsplit_checkpoint_bytes

    def kv_itemsize(self, dtype: str) -> int:
        if dtype == "float32":
            return 4
        return 4 if self.checkpoint_dtype == "float32" else 2

    def kv_bytes(self, dtype: str, tokens: int, kv_bits: int = 0, kv_group_size: int = 64) -> int:
        """KV cache of ``tokens`` tokens, rounded up to the cache's 256-token growth step; with ``kv_bits``, each
        value takes its bits plus its group's scale and bias in the float type (runner/kv_quant.py). An MTP layer
        (runner.drafting.mtp drafts with one) keeps a float cache of its own over the same positions."""
        steps = -(-tokens // 256) * 256
        itemsize = self.kv_itemsize(dtype)
        per_value = kv_bits / 8 + 2 * itemsize / kv_group_size if kv_bits else itemsize
        mtp = min(self.mtp_layers, 1) * self.kv_heads * self.head_dim * 2 * itemsize * steps
        return int(self.layers * self.kv_heads * self.head_dim * 2 * per_value * steps + mtp)


_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def _weigh(tensors: dict, quantization: dict | None, every: dict | None = None) -> tuple[int, int, int, set]:
    """(parameters, checkpoint bytes, float32 bytes, float dtypes stored) of ``tensors`` (safetensors header
    entries); ``every``: all the checkpoint's entries, where a quantized weight's scales are looked up."""
    every = tensors if every is None else every
    parameters = checkpoint = float32 = 0
    float_widths = set()
    for name, info in tensors.items():
        itemsize = SAFETENSORS_ITEMSIZE.get(info["dtype"], 4)
        count = 1
        for dim in info["shape"]:
            count *= dim
        checkpoint += count * itemsize
        if info["dtype"] in FLOAT_DTYPES:
            float_widths.add(info["dtype"])
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.scales" in every:
            scales = every[f"{base}.scales"]["shape"]
            group_size = _group_size(quantization, base)
            unpacked = 1
            for dim in scales[:-1]:
                unpacked *= dim
            unpacked *= scales[-1] * group_size
            parameters += unpacked
            float32 += unpacked * 4
        elif name.endswith((".scales", ".biases")) and f"{name.rsplit('.', 1)[0]}.weight" in every:
            continue  # part of a quantized weight: counted with it
        else:
            parameters += count
            float32 += count * 4
    return parameters, checkpoint, float32, float_widths


def _group_size(quantization: dict | None, layer: str) -> int:
    if quantization is None:
        return 64
    specific = quantization.get(layer)
    if isinstance(specific, dict) and "group_size" in specific:
        return int(specific["group_size"])
    return int(quantization.get("group_size", 64))


def default_prompt_cache_bytes(total_memory: int | None = None) -> int:
    """The prompt cache's budget when nothing sets it: an eighth of the machine's memory, at most 4 GiB.

    The supervisor lowers it to the room a model's memory limit leaves above its estimate
    (``supervisor.memory.prompt_cache_budget``), and its memory policy empties the cache first
    when a runner goes over its soft limit.
    """
    if total_memory is None:
        import psutil

        total_memory = psutil.virtual_memory().total
    return min(total_memory // 8, 4 * 2**30)


@functools.cache  # the installed packages do not change while the supervisor runs
def expected_backend() -> str:
    """What will run MLX in a runner, guessed without importing MLX: "metal", "cuda" or "cpu"."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return "metal"
    names = {(d.metadata["Name"] or "").lower() for d in package_metadata.distributions()}
    return "cuda" if any(name.startswith("mlx-cuda") for name in names) else "cpu"


def expected_device() -> str:
    """The device MLX will use in a runner, guessed without importing MLX: "gpu" or "cpu"."""
    return "cpu" if expected_backend() == "cpu" else "gpu"


def resolve_dtype(
    setting: str, device: str, footprints: list[ModelFootprint], available: int, context: int | None = None
) -> tuple[str, str]:
    """``auto`` -> "checkpoint" or "float32", with the reason in words.

    On a GPU the checkpoint's form is kept (casting a bf16 model to float32 doubles
    its memory for nothing). On the CPU, MLX's quantized and half-precision kernels
    are slow, so ``auto`` takes float32 - unless the float32 estimate does not fit
    in ``available`` bytes, in which case the checkpoint's form is kept and said so.
    """
    if setting in ("checkpoint", "float32"):
        return setting, f"dtype = {setting!r} in the config"
    if device != "cpu":
        return "checkpoint", "auto: the checkpoint's form on the GPU"
    needed = estimate(footprints, "float32", device, context=context).total
    if needed > available:
        return "checkpoint", (
            f"auto: float32 would need ~{needed / 2**20:.0f} MiB, only "
            f"{available / 2**20:.0f} MiB available: keeping the checkpoint's form"
        )
    return "float32", "auto: float32 on the CPU (MLX's quantized and half-precision CPU kernels are slow)"


@dataclass(frozen=True)
class Estimate:
    weights: int
    kv_cache: int
    prefill: int
    runtime: int
    vision: int = 0  # a model that sees: its tower's transient for the largest image request

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.prefill + self.runtime + self.vision


def prefill_score_bytes(
    heads: int, context: int, score_bytes: int = DEFAULT_PREFILL_SCORE_BYTES, max_chunk: int = CPU_PREFILL_CHUNK
) -> int:
    """The largest score matrix a CPU prefill over ``context`` tokens makes (as ``PrefillPlanner.memory_limit``)."""
    chunk = min(max_chunk, context, max(MIN_PREFILL_CHUNK, score_bytes // max(1, heads * context * 4)))
    return heads * chunk * context * 4


def estimate(
    footprints: list[ModelFootprint],
    dtype: str,
    device: str,
    context: int | None = None,
    runtime_overhead: int | None = None,
    score_bytes: int = DEFAULT_PREFILL_SCORE_BYTES,
    kv_bits: int = 0,
    kv_group_size: int = 64,
    ranks: int = 1,
    here: int | None = None,
    images: int = 8,
    image_pixels: int = DEFAULT_IMAGE_PIXELS,
    max_chunk: int = CPU_PREFILL_CHUNK,
) -> Estimate:
    """Peak memory of a runner serving ``footprints`` (target first) at ``dtype`` over ``context`` tokens; with
    ``kv_bits`` the target's KV cache is counted quantized (the draft's stays float). With ``ranks`` > 1 (a
    runner group) the sum over the ``here`` of its processes on this host (default: all of them): their
    share of the target's layers and cache (the largest run of layers a rank gets, for each), and per process
    the target's weights outside its layers (embeddings, head: whole on every rank, in both tensor and
    pipeline parallelism), a whole draft, its cache, a prefill's transient and the runtime. A model that sees
    adds its vision tower's transient for ``images`` images of at most ``image_pixels`` pixels. ``max_chunk``:
    the most tokens a CPU prefill pass takes (``RunnerSettings.prefill_chunk_on``)."""
    target, drafts = footprints[0], footprints[1:]
    here = ranks if here is None else here
    tokens = min(context or target.context_length, target.context_length)
    share = 1.0
    if ranks > 1 and target.layers:
        share = min(1.0, here * -(-target.layers // ranks) / target.layers)
    layers = target.weight_bytes(dtype) - target.unsplit_bytes(dtype)
    split = layers * share + here * target.unsplit_bytes(dtype) if ranks > 1 else target.weight_bytes(dtype)
    weights = int(split * (1 + LOAD_SLACK)) + here * sum(int(f.weight_bytes(dtype) * (1 + LOAD_SLACK)) for f in drafts)
    kv = int(target.kv_bytes(dtype, tokens, kv_bits, kv_group_size) * share) + here * sum(
        f.kv_bytes(dtype, tokens) for f in drafts
    )
    prefill = 0
    if device == "cpu":
        prefill = 2 * here * prefill_score_bytes(max(f.heads for f in footprints), tokens, score_bytes, max_chunk)
    runtime = RUNTIME_OVERHEAD if runtime_overhead is None else runtime_overhead
    if target.kind != "generate":  # an embedding model or reranker (runner/embedding): no cache; a batch's
        # attention scores are kept under score_bytes, its activations are a fraction of them
        return Estimate(weights, 0, 2 * score_bytes, here * runtime, 0)
    vision = 0
    if target.vision is not None:  # the tower runs on rank 0 only
        vision = target.vision.transient(images, image_pixels, device, 4 if dtype == "float32" else 2)
    return Estimate(weights, kv, prefill, here * runtime, vision)
