"""Import a GGUF file into an mlx-lm model folder.

    python -m runner.gguf FILE.gguf OUT_DIR

writes ``config.json`` (with its ``quantization`` entry), ``model.safetensors``
(mlx-lm's parameter names), ``tokenizer.json`` (built with the ``tokenizers``
library from the GGUF vocabulary and merges) and ``tokenizer_config.json``
(BOS/EOS and the chat template). The folder then loads with ``mlx_lm.load``
and serves here like any other.

What it handles: the llama architecture (Llama 1-3, Mistral, SmolLM, TinyLlama
and the rest of that family), qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen),
qwen3, phi3 (Phi-3 mini), gemma3 (Gemma 3 text models, 270M to 27B: sliding-
window layers interleaved with global ones) and gemma2, with F32, F16, BF16, Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
IQ4_NL, IQ4_XS and the K-quants (Q2_K to Q6_K: the Q4_K_M, Q5_K_M, Q3_K_M...
files most GGUF downloads are), and a byte-level BPE (``gpt2``: GPT-2, Llama 3,
SmolLM) or SentencePiece (``llama``: Llama 1-2, Mistral v0.1, TinyLlama, Phi-3)
vocabulary, tokenized as llama.cpp tokenizes it (tested on llama.cpp's own
tokenizer test cases).

- A file of F32/F16/BF16/Q4_0/Q4_1/Q8_0 tensors only is read by ``mx.load``:
  the quantized ones come back in MLX's affine layout (uint32 words plus
  scales and biases, group size 32) exactly, and stay quantized.
- Any other type: ``mx.load`` cannot read such a file (or reads some K-quants
  to float16), so every tensor is read with ``gguf`` (llama.cpp's own Python
  package) and put in MLX's affine layout (group size 32, float32 scales and
  biases), per type:
  - Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K: every group of 32 values is
    scale * level + bias, so the blocks are decoded into those levels, scales
    and biases (``affine_blocks``) and kept at their own bits: the weights are
    exactly those of llama.cpp's dequantization (tested bit for bit);
  - Q2_K, Q3_K, Q6_K: their sub-blocks hold 16 values, a group size MLX does
    not have; IQ4_NL and IQ4_XS (what llama.cpp writes for Q2_K/Q3_K files'
    tensors whose rows are not a multiple of 256) put their 16 levels on a
    non-uniform table. They are dequantized by llama.cpp's reference code
    (``gguf.quants.dequantize``) and quantized again wider (``REQUANTIZED_BITS``:
    4, 4, 8 and 8; ``affine_quantize``: per group of 32, its minimum and
    range), each weight within half a level of the new grid.
  The per-layer widths go into the config's ``quantization`` entry, as
  mlx-lm's mixed-precision recipes write them.

Anything else (another architecture, the other IQ types and the ternary ones,
another kind of vocabulary or pre-tokenizer) is refused with one
``GGUFImportError`` naming it, never imported half-right.

GGUF stores llama's Q and K projection rows interleaved for RoPE (llama.cpp
permutes them on export); the importer puts them back in Hugging Face's order,
so the folder uses mlx-lm's ordinary llama RoPE, as an mlx-community folder does.
Qwen's and Gemma's rows are stored in Hugging Face's order and stay as they are.
Gemma's RMSNorm scales by 1 + weight: llama.cpp stores 1 + weight, so the
importer takes the 1 off again for mlx-lm's Gemma layers; what the files leave
out (Gemma 3's layer pattern, its local RoPE base, the attention scale, and a
chat template for base models) is filled in as llama.cpp fills it in
(``gemma_config``, ``GEMMA_CHAT_TEMPLATE``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from common.progress import byte_bar, spinner


@dataclass(frozen=True)
class Architecture:
    """How a GGUF architecture maps onto an mlx-lm model."""

    model_type: str  # mlx-lm's (and the config's)
    hf_class: str
    permuted_qk: bool  # llama.cpp interleaved the Q/K rows for its RoPE (llama only; Qwen's are as in HF)
    head_dim_key: str | None  # the metadata key giving the head width, where it may differ from hidden / heads
    default_rope_theta: float
    names: tuple = ()  # (GGUF name, mlx-lm name) pairs that differ from LAYER_NAMES' for this architecture
    one_plus_norms: bool = False  # Gemma: RMSNorm scales by 1 + weight; llama.cpp stores 1 + weight, mlx-lm weight

    def layer_name(self, gguf_name: str) -> str | None:
        return dict(self.names).get(gguf_name, LAYER_NAMES.get(gguf_name))


GEMMA_NAMES = (
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
)
# Gemma 3's layer pattern and local RoPE base, which its GGUF files do not store (llama.cpp fixes them too).
GEMMA3_SLIDING_WINDOW_PATTERN = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
# Gemma's chat format, for files that carry no template (base models such as gemma-3-270m): the one in
# Google's tokenizer_config.json, text only: a system message goes in front of the first user turn.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", True, "rope.dimension_count", 10000.0),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", False, None, 1000000.0),  # Q/K/V biases
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", False, "attention.key_length", 1000000.0),  # Q/K norms
    # Phi-3: Q, K and V in one projection, gate and up in another
    "phi3": Architecture(
        "phi3",
        "Phi3ForCausalLM",
        False,
        None,
        10000.0,
        (("attn_qkv", "self_attn.qkv_proj"), ("ffn_up", "mlp.gate_up_proj")),
    ),
    # Gemma 2 and 3: a norm before and after both the attention and the MLP; Gemma 3 adds Q/K norms and
    # interleaves sliding-window layers with global ones (``gemma_config``).
    "gemma2": Architecture("gemma2", "Gemma2ForCausalLM", False, "attention.key_length", 10000.0, GEMMA_NAMES, True),
    "gemma3": Architecture(
        "gemma3_text", "Gemma3ForCausalLM", False, "attention.key_length", 1000000.0, GEMMA_NAMES, True
    ),
}
BY_MODEL_TYPE = {spec.model_type: arch for arch, spec in ARCHITECTURES.items()}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# GGML tensor types whose data mx.load returns unchanged (float) or exactly in MLX's affine layout (quantized).
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# Types the importer converts itself (read with ``gguf``, ``requantized``): the width of their MLX layout, their
# own where their groups of 32 share a scale and a bias, wider where they do not.
REQUANTIZED_BITS = {
    "Q4_K": 4,
    "Q5_K": 5,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q2_K": 4,
    "Q3_K": 4,
    "Q6_K": 8,
    "IQ4_NL": 8,
    "IQ4_XS": 8,
}
BITS = {**QUANTIZED_TYPES, **REQUANTIZED_BITS}  # every quantized type imported: the width of its MLX layout
GGML_GROUP_SIZE = 32
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's names for the regexes it uses).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "gpt-2", "smollm", "llama-bpe", "llama3", "qwen2", "deepseek-r1-qwen")
# Llama 3's: llama.cpp takes a split that is a whole token as it is (ignore_merges) and adds BOS by default.
LLAMA3_PRE_TOKENIZERS = ("llama-bpe", "llama3")
# tokenizer.ggml.token_type values (llama.cpp's, SentencePiece's piece types).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE_PIECE = "\u2581"  # SentencePiece's visible space

# GGUF tensor name (after "blk.N.") -> mlx-lm parameter name.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",  # Qwen3
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFImportError(Exception):
    """The file cannot be imported; the message says why in one line."""


# -- reading ---------------------------------------------------------------------------------------


def open_reader(path: Path):
    """``gguf``'s reader (llama.cpp's own) of the file: its header, metadata and tensors, parsed once."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - any parse failure is a bad file
        load_gguf(path)  # mx.load's message is the clearer one (a file cut short "extends past the end of the file")
        raise GGUFImportError(f"{path}: cannot read the GGUF header: {type(error).__name__}: {error}") from None


def tensor_types(reader) -> dict[str, str]:
    """GGML type name of every tensor."""
    return {t.name: t.tensor_type.name for t in reader.tensors}


def check_magic(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as error:
        raise GGUFImportError(f"{path}: {error.strerror}") from None
    if magic != b"GGUF":
        raise GGUFImportError(f"{path} is not a GGUF file (it does not start with the GGUF magic)")


def load_gguf(path: Path):
    """(weights, metadata) from mx.load, every failure as a GGUFImportError."""
    import mlx.core as mx

    try:
        return mx.load(str(path), return_metadata=True)
    except Exception as error:  # noqa: BLE001 - mx.load raises RuntimeError/ValueError for bad files
        message = str(error).removeprefix("[load_gguf] ")
        raise GGUFImportError(f"{path}: cannot load the tensors: {message}") from None


def pack_levels(levels, bits: int):
    """MLX's packed layout of quantized levels (uint8, rows x columns, each < 2**bits): each row's levels as one
    little-endian bit stream, ``bits`` bits apiece, in uint32 words (what ``mx.dequantize`` reads, any width)."""
    import numpy as np

    rows, columns = levels.shape
    if 32 % bits == 0:  # whole levels per word
        per_word = 32 // bits
        grouped = levels.reshape(rows, columns // per_word, per_word).astype(np.uint32)
        return np.bitwise_or.reduce(grouped << (np.arange(per_word, dtype=np.uint32) * bits), axis=-1)
    stream = (levels[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(stream.reshape(rows, -1, 8), axis=-1, bitorder="little").reshape(rows, -1).view(np.uint32)


def affine_quantize(values, bits: int, group_size: int = GGML_GROUP_SIZE) -> dict:
    """``values`` (float32, rows x columns) in MLX's affine layout: per group, bias = its minimum and scale = its
    range over 2**bits - 1 levels. Unlike ``mx.quantize`` (which moves the grid so that zero falls on a level),
    this keeps a GGML block's own grid: a group of values d * q + m that uses its lowest and highest level
    comes back exactly, and any other value within half a level. Scales and biases in float32."""
    import mlx.core as mx
    import numpy as np

    rows, columns = values.shape
    groups = values.reshape(rows, columns // group_size, group_size)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    top = 2**bits - 1
    scale = np.where(high > low, (high - low) / top, 1.0).astype(np.float32)
    levels = np.clip(np.rint((groups - low[..., None]) / scale[..., None]), 0, top).astype(np.uint8)
    return {
        "weight": mx.array(pack_levels(levels.reshape(rows, columns), bits)),
        "scales": mx.array(scale),
        "biases": mx.array(low.astype(np.float32)),
    }


def _f16(column):
    return column.copy().view("float16").astype("float32")


def _nibbles(qs, groups: int):
    """Packed 4-bit levels, llama.cpp's order: a run of n bytes holds levels 0..n-1 in its low nibbles and
    n..2n-1 in its high ones (n = 16 for a 32-level block, 32 for each 64-level run of a K-quant)."""
    import numpy as np

    blocks = qs.shape[0]
    runs = qs.reshape(blocks, groups, 1, -1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & 0x0F).reshape(blocks, -1)


def _high_bits(qh, count: int):
    """Bit i of the little-endian bit field ``qh`` (one row per block) for i < count, as uint8 0/1."""
    import numpy as np

    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]


def _k_scales(scales):
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block (llama.cpp's get_scale_min_k4)."""
    import numpy as np

    d, m, md = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape(-1, 8)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape(-1, 8)
    return sc.astype("float32"), mn.astype("float32")


def affine_blocks(blocks, kind: str):
    """The blocks of a GGML type whose groups of 32 values are each ``scale * level + bias`` (one row per block)
    as (levels: uint8 per value, scale and bias: float32 per group of 32), exactly what llama.cpp's
    dequantization computes; None for the other types."""
    import numpy as np

    n = blocks.shape[0]
    if kind == "Q8_0":  # d, 32 x int8
        d = _f16(blocks[:, :2])
        return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, -128 * d
    if kind == "Q4_0":  # d, 16 bytes of nibbles; value d * (level - 8)
        d = _f16(blocks[:, :2])
        return _nibbles(blocks[:, 2:], 1), d, -8 * d
    if kind == "Q4_1":  # d, m, nibbles; value d * level + m
        return _nibbles(blocks[:, 4:], 1), _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    if kind in ("Q5_0", "Q5_1"):  # d, (m,) 32 high bits, nibbles; Q5_0: d * (level - 16)
        start = 2 if kind == "Q5_0" else 4
        levels = _nibbles(blocks[:, start + 4 :], 1) | (_high_bits(blocks[:, start : start + 4], 32) << 4)
        d = _f16(blocks[:, :2])
        return levels, d, (-16 * d if kind == "Q5_0" else _f16(blocks[:, 2:4]))
    if kind in ("Q4_K", "Q5_K"):  # d, dmin, 12 bytes of 6-bit scales and mins, (32 bytes of high bits,) nibbles
        sc, mn = _k_scales(blocks[:, 4:16])
        scale = (_f16(blocks[:, :2]) * sc).reshape(-1)
        bias = -(_f16(blocks[:, 2:4]) * mn).reshape(-1)
        if kind == "Q4_K":
            levels = _nibbles(blocks[:, 16:], 4)
        else:
            high = _high_bits(blocks[:, 16:48], 256).reshape(n, 32, 8).transpose(0, 2, 1).reshape(n, 256)
            levels = _nibbles(blocks[:, 48:], 4) | (high << 4)
        return levels.reshape(-1, 32), scale[:, None], bias[:, None]
    return None


def requantized(data, kind: str, bits: int) -> dict:
    """One quantized tensor of GGML type ``kind`` (``data``: its raw blocks, a row of blocks per output row, as
    ``gguf.GGUFReader`` gives them) in MLX's affine layout, group size 32, scales and biases in float32.

    A type whose groups of 32 are each scale * level + bias (``affine_blocks``) keeps its levels, scales and biases
    exactly, at its own bits. The others are dequantized by llama.cpp's code and quantized again at ``bits``
    (``affine_quantize``)."""
    import mlx.core as mx
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    rows = data.shape[0]
    exact = affine_blocks(data.reshape(-1, GGML_QUANT_SIZES[qtype][1]), kind)
    if exact is None:
        return affine_quantize(dequantize(data, qtype).astype("float32"), bits)
    levels, scale, bias = exact
    return {
        "weight": mx.array(pack_levels(levels.reshape(rows, -1), bits)),
        "scales": mx.array(scale.reshape(rows, -1)),
        "biases": mx.array(bias.reshape(rows, -1)),
    }


def read_tensors(reader, advance=lambda nbytes: None) -> dict:
    """Every tensor, from ``gguf``'s reader, under mx.load's names: float tensors as they are, quantized ones in
    MLX's affine layout at their ``BITS``. ``advance`` is told each tensor's bytes once it is read."""
    import mlx.core as mx
    from gguf.quants import dequantize

    weights = {}
    for tensor in reader.tensors:
        advance(int(tensor.n_bytes))
        kind = tensor.tensor_type.name
        if kind in FLOAT_TYPES:
            values = dequantize(tensor.data, tensor.tensor_type) if kind == "BF16" else tensor.data
            weights[tensor.name] = mx.array(values).reshape(tuple(reversed(tensor.shape.tolist())))
            continue
        base = tensor.name.removesuffix(".weight")
        for suffix, array in requantized(tensor.data, kind, BITS[kind]).items():
            weights[f"{base}.{suffix}"] = array
    return weights


def read_metadata(reader) -> dict:
    """The key-value metadata as ``mx.load`` gives it: numbers as 0-d arrays, number lists as arrays, strings and
    string lists as they are (from ``gguf``'s reader, for files ``mx.load`` cannot read)."""
    import numpy as np
    from gguf import GGUFValueType

    metadata = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types[-1] not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
            value = np.asarray(value)
        metadata[name] = value
    return metadata


def scalar(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if value is None:
        raise GGUFImportError(f"the GGUF metadata has no {key}")
    if hasattr(value, "item"):
        return value.item()
    return value


# -- the model -------------------------------------------------------------------------------------


def model_config(metadata: dict, weights: dict, quantization: dict | None) -> dict:
    arch = metadata["general.architecture"]
    spec, p = ARCHITECTURES[arch], f"{arch}."
    heads = scalar(metadata, p + "attention.head_count")
    hidden = scalar(metadata, p + "embedding_length")
    vocab_size = metadata.get(p + "vocab_size")
    vocab_size = vocab_size.item() if vocab_size is not None else len(metadata["tokenizer.ggml.tokens"])
    head_dim = scalar(metadata, p + spec.head_dim_key, hidden // heads) if spec.head_dim_key else hidden // heads
    config = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "hidden_size": hidden,
        "intermediate_size": scalar(metadata, p + "feed_forward_length"),
        "num_hidden_layers": scalar(metadata, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(metadata, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(scalar(metadata, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(scalar(metadata, p + "rope.freq_base", spec.default_rope_theta)),
        "rope_traditional": False,  # llama's Q/K rows are un-permuted on import; Qwen's were never permuted
        "max_position_embeddings": scalar(metadata, p + "context_length", 2048),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in weights,
        "bos_token_id": scalar(metadata, "tokenizer.ggml.bos_token_id", 1),
        "eos_token_id": scalar(metadata, "tokenizer.ggml.eos_token_id", 2),
    }
    scaling = metadata.get(p + "rope.scaling.type")
    if scaling is not None and scaling != "none":
        if scaling != "linear":
            raise GGUFImportError(f"unsupported RoPE scaling {scaling!r} (supported: linear)")
        config["rope_scaling"] = {"type": "linear", "factor": float(scalar(metadata, p + "rope.scaling.factor"))}
    if "rope_freqs.weight" in weights or "rope_factors_long.weight" in weights:
        raise GGUFImportError(
            "unsupported RoPE scaling: per-frequency factors (rope_freqs, Llama 3.1 style; "
            "rope_factors, Phi-3 128k style)"
        )
    rotary = scalar(metadata, p + "rope.dimension_count", head_dim) if arch == "phi3" else head_dim
    if rotary != head_dim:  # Phi-3 may rotate part of each head
        config["partial_rotary_factor"] = rotary / head_dim
    if arch == "phi3":
        config["original_max_position_embeddings"] = config["max_position_embeddings"]
    if arch in ("gemma2", "gemma3"):
        config.update(gemma_config(metadata, config))
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def gemma_config(metadata: dict, config: dict) -> dict:
    """What mlx-lm's gemma2 / gemma3_text read beyond llama's keys.

    - Attention scale: 1 / sqrt(head_dim), except the 27B models (46 layers in Gemma 2, 62 in Gemma 3), which
      scale by hidden / heads; llama.cpp decides it the same way, as the files do not store it.
    - Gemma 3: a sliding window on five layers of every six, with a local RoPE base of 10,000.
    - Gemma 2: mlx-lm's gemma2 attends over the whole context on every layer, where Gemma 2 alternates
      sliding-window layers (4,096) with global ones; the two agree while the context fits the window, so the
      context is capped at the window rather than serving answers that part from the model's past it.
    """
    arch = metadata["general.architecture"]
    p = f"{arch}."
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    big = layers == (46 if arch == "gemma2" else 62)
    extra = {"query_pre_attn_scalar": hidden // heads if big else config["head_dim"]}
    window = int(scalar(metadata, p + "attention.sliding_window", 4096))
    if arch == "gemma3":
        extra |= {
            "sliding_window": window,
            "sliding_window_pattern": sliding_window_pattern(metadata.get(p + "attention.sliding_window_pattern")),
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        }
    else:
        extra |= {
            "attn_logit_softcapping": float(scalar(metadata, p + "attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(scalar(metadata, p + "final_logit_softcapping", 30.0)),
            "max_position_embeddings": min(config["max_position_embeddings"], window),
        }
    return extra


def sliding_window_pattern(stored) -> int:
    """Gemma 3's period of sliding and global layers (every n-th layer is global): llama.cpp's fixed 6 where the
    file does not say; a number as it is; a list of per-layer flags (true = sliding) if it repeats one period,
    the only layout mlx-lm's gemma3_text builds."""
    if stored is None:
        return GEMMA3_SLIDING_WINDOW_PATTERN
    if not isinstance(stored, (list, tuple)) and getattr(stored, "ndim", 1) == 0:
        return int(stored.item() if hasattr(stored, "item") else stored)
    flags = [bool(flag) for flag in as_list(stored)]
    period = flags.index(False) + 1 if False in flags else 0
    if period == 0 or any(flag != ((i + 1) % period != 0) for i, flag in enumerate(flags)):
        raise GGUFImportError(f"unsupported sliding-window layout {flags} (supported: every n-th layer global)")
    return period


def check_supported(metadata: dict, types: dict[str, str]) -> None:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(
            f"unsupported architecture {arch!r} (this importer handles: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    for name, kind in types.items():
        if kind not in FLOAT_TYPES and kind not in BITS:
            raise GGUFImportError(
                f"unsupported quantization type {kind} (tensor {name}); supported: {', '.join((*FLOAT_TYPES, *BITS))}"
            )


def mlx_name(gguf_name: str, arch: str = "llama") -> str | None:
    """mlx-lm's name for a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    parts = gguf_name.split(".")
    layer = ARCHITECTURES[arch].layer_name(parts[2]) if parts[0] == "blk" and len(parts) == 4 else None
    if layer is not None:
        return f"model.layers.{parts[1]}.{layer}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(array, n_head: int):
    """Undo llama.cpp's RoPE row interleaving of a Q or K projection (rows are output features)."""
    rows = array.shape[0]
    return array.reshape(n_head, rows // n_head // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def convert_weights(weights: dict, config: dict) -> dict:
    """GGUF arrays (weight/scales/biases, and bias) under mlx-lm's names, llama's Q/K rows back in HF order."""
    arch = BY_MODEL_TYPE[config["model_type"]]
    spec = ARCHITECTURES[arch]
    permuted = spec.permuted_qk
    converted = {}
    unknown = []
    for name, array in weights.items():
        base, _, suffix = name.rpartition(".")
        target = mlx_name(f"{base}.weight", arch)
        if target is None:
            unknown.append(name)
            continue
        target = target.removesuffix(".weight") + f".{suffix}"
        if permuted and ".attn_q." in name:
            array = unpermute_rows(array, config["num_attention_heads"])
        elif permuted and ".attn_k." in name:
            array = unpermute_rows(array, config["num_key_value_heads"])
        elif spec.one_plus_norms and base.endswith("norm"):
            array = array - 1.0  # llama.cpp wrote 1 + weight (its RMSNorm multiplies by the weight as it is)
        converted[target] = array
    if unknown:
        raise GGUFImportError(
            f"unexpected tensors for a {config['model_type']} model: {', '.join(sorted(unknown)[:5])}"
        )
    return converted


def quantization_entry(types: dict[str, str], arch: str) -> dict | None:
    """mlx-lm's ``quantization`` config: the most common width, per-layer entries for the others."""
    bits = {name: BITS[kind] for name, kind in types.items() if kind in BITS}
    if not bits:
        return None
    widths = list(bits.values())
    default = max(set(widths), key=widths.count)
    entry = {"group_size": GGML_GROUP_SIZE, "bits": default}
    for name, width in sorted(bits.items()):
        if width != default:
            layer = mlx_name(name, arch).removesuffix(".weight")
            entry[layer] = {"group_size": GGML_GROUP_SIZE, "bits": width}
    return entry


# -- the tokenizer ---------------------------------------------------------------------------------


def pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind in ("default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    patterns = {
        "llama-bpe": LLAMA3_PATTERN,
        "llama3": LLAMA3_PATTERN,
        "qwen2": QWEN2_PATTERN,
        "deepseek-r1-qwen": QWEN2_PATTERN,
    }
    if kind in patterns:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(patterns[kind]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFImportError(f"unsupported pre-tokenizer {kind!r} (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")


def build_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` from the GGUF vocabulary (``tokenizer.ggml.model``: ``gpt2`` or ``llama``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = byte_level_tokenizer(metadata)
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(metadata)
    else:
        raise GGUFImportError(
            f"unsupported tokenizer model {kind!r} (supported: gpt2 - byte-level BPE, llama - SentencePiece BPE)"
        )
    add_special_tokens(tokenizer, metadata)
    add_bos, add_eos = bos_eos(metadata)
    if add_bos or add_eos:  # the tokenizer adds them itself: transformers ignores tokenizer_config's flags
        tokenizer.post_processor = with_bos_eos(tokenizer.post_processor, metadata, add_bos, add_eos)
    return tokenizer


def bos_eos(metadata: dict) -> tuple[bool, bool]:
    """Whether a prompt gets BOS in front and EOS behind, as llama.cpp decides: the file's flags, and where the
    file does not say (older files), BOS for a SentencePiece or Llama 3 vocabulary."""
    default_bos = (
        metadata.get("tokenizer.ggml.model") == "llama" or metadata.get("tokenizer.ggml.pre") in LLAMA3_PRE_TOKENIZERS
    )
    return (
        bool(scalar(metadata, "tokenizer.ggml.add_bos_token", default_bos)),
        bool(scalar(metadata, "tokenizer.ggml.add_eos_token", False)),
    )


def with_bos_eos(processor, metadata: dict, add_bos: bool, add_eos: bool):
    from tokenizers import processors

    tokens, special = metadata["tokenizer.ggml.tokens"], []
    for wanted, key in ((add_bos, "tokenizer.ggml.bos_token_id"), (add_eos, "tokenizer.ggml.eos_token_id")):
        if wanted:
            index = int(scalar(metadata, key))
            special.append((tokens[index], index))
    single = " ".join(([special[0][0]] if add_bos else []) + ["$A"] + ([special[-1][0]] if add_eos else []))
    template = processors.TemplateProcessing(single=single, pair=f"{single} $B", special_tokens=special)
    return processors.Sequence([processor, template]) if processor is not None else template


def byte_level_tokenizer(metadata: dict):
    """Byte-level BPE (GPT-2, Llama 3, SmolLM): the file's merges, split as its ``tokenizer.ggml.pre`` says."""
    from tokenizers import Tokenizer, decoders, models, processors

    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    kind = metadata.get("tokenizer.ggml.pre", "default")
    # Llama 3 takes a split that is a whole token as it is, even where no merges lead to it (" Việt").
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=kind in LLAMA3_PRE_TOKENIZERS
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizer(kind)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def sentencepiece_tokenizer(metadata: dict):
    """SentencePiece BPE (Llama 1-2, Mistral v0.1, TinyLlama, Phi-3): pieces with scores and ``<0xNN>`` byte
    pieces for what no piece spells, as llama.cpp tokenizes them.

    - Text: spaces become ``▁`` and each run of text gets a ``▁`` in front (``tokenizer.ggml.add_space_prefix``,
      on unless the file says otherwise), the text after a special token too: llama.cpp's rule, and
      Hugging Face's "legacy" Llama tokenizer's. (transformers' own GGUF import leaves the ``▁`` off text that
      starts with a space, or follows a special token, and so tokenizes differently from llama.cpp.)
    - Merges: the file's if it has them, else SentencePiece's own order (``sentencepiece_merges``).
    - Characters no piece spells fall back to their UTF-8 bytes.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens = list(metadata["tokenizer.ggml.tokens"])
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = sentencepiece_merges(tokens, as_list(metadata["tokenizer.ggml.scores"]), token_types(metadata))
    unknown = metadata.get("tokenizer.ggml.unknown_token_id")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            fuse_unk=True,
            byte_fallback=True,
            unk_token=tokens[int(unknown)] if unknown is not None else None,
        )
    )
    prefix = bool(scalar(metadata, "tokenizer.ggml.add_space_prefix", True))
    tokenizer.normalizer = normalizers.Sequence(
        ([normalizers.Prepend(SPACE_PIECE)] if prefix else []) + [normalizers.Replace(" ", SPACE_PIECE)]
    )
    steps = [decoders.Replace(SPACE_PIECE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a normal piece into two normal pieces,
    the pieces with the higher score first. SentencePiece merges the adjacent pair whose union scores highest,
    and never into or out of a control, byte or unknown piece; a BPE model with these merges does the same."""
    normal = {
        token: index
        for index, token in enumerate(tokens)
        if types[index] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)
    }
    merges = []
    for piece, index in normal.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-scores[index], normal[left], normal[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def as_list(values) -> list:
    """A metadata array (MLX's or NumPy's) as a Python list: element by element they are slow to read."""
    return values.tolist() if hasattr(values, "tolist") else list(values)


def token_types(metadata: dict) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    return as_list(types) if types is not None else [TOKEN_TYPE_NORMAL] * len(metadata["tokenizer.ggml.tokens"])


def add_special_tokens(tokenizer, metadata: dict) -> None:
    """Control tokens (``<s>``, ``<|im_end|>``) as special tokens and user-defined ones as added tokens: both
    match whole in the text, as llama.cpp matches them, instead of being cut into pieces."""
    from tokenizers import AddedToken

    tokens, types = metadata["tokenizer.ggml.tokens"], token_types(metadata)
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED
        ]
    )


def tokenizer_config(metadata: dict) -> dict:
    tokens = metadata["tokenizer.ggml.tokens"]
    add_bos, add_eos = bos_eos(metadata)

    def token(key):
        value = metadata.get(key)
        return tokens[value.item()] if value is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(scalar(metadata, f"{metadata['general.architecture']}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    elif metadata["general.architecture"] in ("gemma2", "gemma3"):
        config["chat_template"] = GEMMA_CHAT_TEMPLATE
    return {k: v for k, v in config.items() if v is not None}


# -- the whole import ------------------------------------------------------------------------------


def import_gguf(source: str | Path, out_dir: str | Path) -> Path:
    """Write an mlx-lm folder for ``source`` into ``out_dir``; returns the folder."""
    import mlx.core as mx

    source, out = Path(source), Path(out_dir)
    if not source.is_file():
        raise GGUFImportError(f"{source}: no such file")
    check_magic(source)
    reader = open_reader(source)
    types = tensor_types(reader)
    name = source.name
    if all(kind in FLOAT_TYPES or kind in QUANTIZED_TYPES for kind in types.values()):
        with spinner(f"{name}: reading {len(types)} tensors"):
            weights, metadata = load_gguf(source)  # exact; says clearly when the file is cut short
        check_supported(metadata, types)
    else:
        metadata = read_metadata(reader)
        check_supported(metadata, types)
        total = sum(int(tensor.n_bytes) for tensor in reader.tensors)
        with byte_bar(f"{name}: {len(types)} tensors", total) as advance:
            weights = read_tensors(reader, advance)
    tokenizer = build_tokenizer(metadata)
    quantization = quantization_entry(types, metadata["general.architecture"])
    config = model_config(metadata, weights, quantization)
    with spinner(f"{name}: converting and writing {out / 'model.safetensors'}"):
        converted = convert_weights(weights, config)
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / "model.safetensors"), converted, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m runner.gguf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the mlx-lm folder to write")
    args = parser.parse_args(argv)
    try:
        out = import_gguf(args.gguf, args.out_dir)
    except GGUFImportError as error:
        print(f"runner.gguf: {error}", file=sys.stderr)
        return 2
    print(f"imported {args.gguf} into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
