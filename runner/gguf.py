"""Import a GGUF file into an mlx-lm model folder.

    python -m runner.gguf FILE.gguf OUT_DIR

writes ``config.json`` (with its ``quantization`` entry), ``model.safetensors``
(mlx-lm's parameter names), ``tokenizer.json`` (built with the ``tokenizers``
library from the GGUF vocabulary and merges) and ``tokenizer_config.json``
(BOS/EOS and the chat template). The folder then loads with ``mlx_lm.load``
and serves here like any other.

What it handles: the llama architecture (Llama 1-3, Mistral, SmolLM, TinyLlama
and the rest of that family) with F32, F16, BF16, Q4_0, Q4_1 and Q8_0 tensors,
and a byte-level BPE (``gpt2``) vocabulary. ``mx.load`` reads the file: Q4_0,
Q4_1 and Q8_0 tensors come back in MLX's affine quantized layout (uint32 words
plus scales and biases, group size 32), so quantized weights stay quantized.
Anything else (another architecture, a K-quant, a SentencePiece vocabulary) is
refused with one ``GGUFImportError`` naming it, never imported half-right.

GGUF stores llama's Q and K projection rows interleaved for RoPE (llama.cpp
permutes them on export); the importer puts them back in Hugging Face's order,
so the folder uses mlx-lm's ordinary llama RoPE, as an mlx-community folder does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("llama",)
# GGML tensor types whose data mx.load returns unchanged (float) or in MLX's affine layout (quantized).
FLOAT_TYPES = ("F32", "F16", "BF16")
QUANTIZED_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GGML_GROUP_SIZE = 32
# tokenizer.ggml.pre -> how text is split before BPE (llama.cpp's names for the regexes it uses).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# GGUF tensor name (after "blk.N.") -> mlx-lm parameter name.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFImportError(Exception):
    """The file cannot be imported; the message says why in one line."""


# -- reading ---------------------------------------------------------------------------------------


def read_tensor_types(path: Path) -> dict[str, str]:
    """GGML type name of every tensor, from the file's header (``gguf``, llama.cpp's own reader)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - any parse failure is a bad file
        raise GGUFImportError(f"{path}: cannot read the GGUF header: {type(error).__name__}: {error}") from None
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


def scalar(metadata: dict, key: str, default=None):
    value = metadata.get(key, default)
    if value is None:
        raise GGUFImportError(f"the GGUF metadata has no {key}")
    if hasattr(value, "item"):
        return value.item()
    return value


# -- the model -------------------------------------------------------------------------------------


def model_config(metadata: dict, weights: dict, quantization: dict | None) -> dict:
    arch = "llama"
    p = f"{arch}."
    heads = scalar(metadata, p + "attention.head_count")
    hidden = scalar(metadata, p + "embedding_length")
    vocab_size = metadata.get(p + "vocab_size")
    vocab_size = vocab_size.item() if vocab_size is not None else len(metadata["tokenizer.ggml.tokens"])
    config = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": scalar(metadata, p + "feed_forward_length"),
        "num_hidden_layers": scalar(metadata, p + "block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": scalar(metadata, p + "attention.head_count_kv", heads),
        "head_dim": scalar(metadata, p + "rope.dimension_count", hidden // heads),
        "rms_norm_eps": float(scalar(metadata, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(scalar(metadata, p + "rope.freq_base", 10000.0)),
        "rope_traditional": False,  # Q/K rows are un-permuted on import
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
    if "rope_freqs.weight" in weights:
        raise GGUFImportError("unsupported RoPE scaling: per-frequency factors (rope_freqs, Llama 3.1 style)")
    if quantization is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def check_supported(metadata: dict, types: dict[str, str]) -> None:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFImportError(f"unsupported architecture {arch!r} (this importer handles: "
                              f"{', '.join(SUPPORTED_ARCHITECTURES)})")
    for name, kind in types.items():
        if kind not in FLOAT_TYPES and kind not in QUANTIZED_TYPES:
            raise GGUFImportError(
                f"unsupported quantization type {kind} (tensor {name}); supported: "
                f"{', '.join((*FLOAT_TYPES, *QUANTIZED_TYPES))}")


def mlx_name(gguf_name: str) -> str | None:
    """mlx-lm's name for a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.{parts[1]}"
    return None


def unpermute_rows(array, n_head: int):
    """Undo llama.cpp's RoPE row interleaving of a Q or K projection (rows are output features)."""
    rows = array.shape[0]
    return array.reshape(n_head, rows // n_head // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)


def convert_weights(weights: dict, config: dict) -> dict:
    """GGUF arrays (weight/scales/biases) under mlx-lm's names, Q/K rows back in HF order."""
    converted = {}
    unknown = []
    for name, array in weights.items():
        base, _, suffix = name.rpartition(".")
        target = mlx_name(f"{base}.weight")
        if target is None:
            unknown.append(name)
            continue
        target = target.removesuffix(".weight") + f".{suffix}"
        if ".attn_q." in name:
            array = unpermute_rows(array, config["num_attention_heads"])
        elif ".attn_k." in name:
            array = unpermute_rows(array, config["num_key_value_heads"])
        converted[target] = array
    if unknown:
        raise GGUFImportError(f"unexpected tensors for a llama model: {', '.join(sorted(unknown)[:5])}")
    return converted


def quantization_entry(types: dict[str, str]) -> dict | None:
    """mlx-lm's ``quantization`` config: the most common width, per-layer entries for the others."""
    bits = {name: QUANTIZED_TYPES[kind] for name, kind in types.items() if kind in QUANTIZED_TYPES}
    if not bits:
        return None
    widths = list(bits.values())
    default = max(set(widths), key=widths.count)
    entry = {"group_size": GGML_GROUP_SIZE, "bits": default}
    for name, width in sorted(bits.items()):
        if width != default:
            layer = mlx_name(name).removesuffix(".weight")
            entry[layer] = {"group_size": GGML_GROUP_SIZE, "bits": width}
    return entry


# -- the tokenizer ---------------------------------------------------------------------------------


def pre_tokenizer(kind: str):
    from tokenizers import Regex, pre_tokenizers

    if kind in ("default", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if kind in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFImportError(f"unsupported pre-tokenizer {kind!r} (supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)})")


def build_tokenizer(metadata: dict):
    """A ``tokenizers.Tokenizer`` from the GGUF vocabulary, merges and token types."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFImportError(f"unsupported tokenizer model {kind!r} (supported: gpt2, byte-level BPE)")
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
               if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)
    return tokenizer


def tokenizer_config(metadata: dict) -> dict:
    tokens = metadata["tokenizer.ggml.tokens"]

    def token(key):
        value = metadata.get(key)
        return tokens[value.item()] if value is not None else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(scalar(metadata, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(scalar(metadata, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(scalar(metadata, "llama.context_length", 2048)),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return {k: v for k, v in config.items() if v is not None}


# -- the whole import ------------------------------------------------------------------------------


def import_gguf(source: str | Path, out_dir: str | Path) -> Path:
    """Write an mlx-lm folder for ``source`` into ``out_dir``; returns the folder."""
    import mlx.core as mx

    source, out = Path(source), Path(out_dir)
    if not source.is_file():
        raise GGUFImportError(f"{source}: no such file")
    check_magic(source)
    weights, metadata = load_gguf(source)  # says clearly when the file is cut short
    types = read_tensor_types(source)
    check_supported(metadata, types)
    tokenizer = build_tokenizer(metadata)
    quantization = quantization_entry(types)
    config = model_config(metadata, weights, quantization)
    converted = convert_weights(weights, config)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), converted, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(metadata), indent=2) + "\n")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
