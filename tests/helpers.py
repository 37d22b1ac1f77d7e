"""Helpers the tests share (fixtures live in conftest.py; helpers are imported from here)."""

from __future__ import annotations

import json
import shutil

from runner.defaults import DEFAULT_DRAFT


def collect(rounds):
    """All token ids, the whole text and the final round of a generation."""
    tokens, text, last = [], "", None
    for last in rounds:
        tokens += last.token_ids
        text += last.text
    return tokens, text, last


def draft_with_swapped_vocabulary(folder):
    """A copy of the default draft whose tokenizer has the same size but two ids swapped."""
    shutil.copytree(DEFAULT_DRAFT, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def save_model_folder(model, config: dict, folder):
    """An mlx-lm folder holding ``model``'s weights and ``config``, with the default pair's tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from runner.defaults import DEFAULT_TARGET

    mx.eval(model.parameters())
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TARGET / name, folder / name)
    return folder


def tiny_hybrid_model(folder, seed: int = 0):
    """A tiny randomly initialised LFM2 (convolution layers with ArraysCache, attention layers with KVCache).

    Its caches cannot all be trimmed, which is what the runner must notice. It
    shares the default pair's tokenizer, so the default draft fits it by vocabulary.
    """
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import lfm2

    config = {
        "model_type": "lfm2", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "norm_eps": 1e-5,
        "conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3],
        "tie_word_embeddings": True,
    }
    mx.random.seed(seed)
    model = lfm2.Model(lfm2.ModelArgs.from_dict(config))
    # Larger weights than the default init, so greedy choices are clear-cut rather than near-ties.
    model.update(tree_map(lambda w: w * 4 if w.ndim == 2 else w, model.parameters()))
    return save_model_folder(model, config, folder)


def tiny_sliding_window_model(folder, seed: int = 0):
    """A tiny random llama whose even layers attend through a 64-token sliding window (RotatingKVCache):
    a cache that cannot be rewound once the window is full, so the runner serves it with plain decoding."""
    import mlx.core as mx
    from mlx_lm.models import llama

    config = {
        "model_type": "llama", "vocab_size": 4096, "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return save_model_folder(model, config, folder)


def rewrite_gguf(source, destination, new_type):
    """``source`` again with each tensor in ``new_type(name, type)`` (None: as it is), its metadata unchanged."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(destination), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        kind = new_type(tensor.name, tensor.tensor_type)
        if kind is None:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        else:
            writer.add_tensor(tensor.name, quantize(dequantize(tensor.data, tensor.tensor_type), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination
