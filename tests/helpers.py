"""Helpers the tests share (fixtures live in conftest.py; helpers are imported from here)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from common.defaults import DEFAULT_DRAFT

CHAT_TOKEN = "chat-test-token"  # the API key of the client API tests' supervisor (conftest.chat_supervisor)


def collect(rounds):
    """All token ids, the whole text and the final round of a generation."""
    tokens, text, last = [], "", None
    for last in rounds:
        tokens += last.token_ids
        text += last.text
    return tokens, text, last


class Peak:
    """The most requests a worker decoded at once (``most``), read while ``most_active`` watched."""

    most = 0


@contextmanager
def most_active(worker):
    """Watch ``worker.active`` every millisecond while the block runs; the ``Peak`` it yields holds the most."""
    peak, done = Peak(), threading.Event()

    def watch():
        while not done.is_set():
            peak.most = max(peak.most, worker.active)
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()


def batched_and_alone(engine, prompts: list[str], **fields) -> tuple[list, list]:
    """Each prompt's tokens decoded together through a worker (asserted batched), and each alone (``Engine.generate``):
    (batched, alone)."""
    from runner.request import GenerationRequest
    from runner.worker import MlxWorker

    alone = [collect(engine.generate(GenerationRequest(prompt=p, **fields)))[0] for p in prompts]
    worker = MlxWorker(engine, max_queue=8, max_batch=4)
    worker.start()
    try:
        steps = worker.batched_steps
        jobs = [worker.submit(engine.prepare(GenerationRequest(prompt=p, **fields))) for p in prompts]
        batched = [[t for r in job.results() for t in r.token_ids] for job in jobs]
        assert worker.batched_steps > steps
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
    return batched, alone


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

    from common.defaults import DEFAULT_TARGET

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
        "model_type": "lfm2",
        "vocab_size": 4096,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "full_attn_idxs": [1, 3],
        "tie_word_embeddings": True,
    }
    mx.random.seed(seed)
    model = lfm2.Model(lfm2.ModelArgs.from_dict(config))
    # Larger weights than the default init, so greedy choices are clear-cut rather than near-ties.
    model.update(tree_map(lambda w: w * 4 if w.ndim == 2 else w, model.parameters()))
    return save_model_folder(model, config, folder)


def tiny_cache_list_model(folder, seed: int = 0):
    """A tiny randomly initialised falcon_h1: every layer a Mamba mixer and attention side by side, its cache a
    ``CacheList`` of a convolution/SSM state (ArraysCache) and a KVCache. The default pair's tokenizer, so the
    default draft fits it by vocabulary."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models import falcon_h1

    config = {
        "model_type": "falcon_h1",
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "mamba_d_ssm": 64,
        "mamba_n_heads": 2,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    mx.random.seed(seed)
    model = falcon_h1.Model(falcon_h1.ModelArgs.from_dict(config))
    model.update(tree_map(lambda w: w * 4 if w.ndim == 2 else w, model.parameters()))  # clear-cut greedy choices
    return save_model_folder(model, config, folder)


def tiny_sliding_window_model(folder, seed: int = 0):
    """A tiny random llama whose even layers attend through a 64-token sliding window (RotatingKVCache):
    a cache that cannot be rewound once the window is full, so the runner serves it with plain decoding."""
    import mlx.core as mx
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "sliding_window": 64,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    return save_model_folder(model, config, folder)


def quantize_q4_k(values):
    """``values`` (float32, rows x a multiple of 256) as Q4_K blocks, the way llama.cpp lays them out (``gguf`` has
    no K-quant quantizer): per 32 values a 6-bit scale and min under the block's float16 d and dmin, 4-bit levels.
    Plain rounding (llama.cpp searches for better scales); tested against ``gguf.quants.dequantize``."""
    import numpy as np

    sub = values.astype(np.float32).reshape(-1, 8, 32)
    low, high = np.minimum(sub.min(axis=-1), 0), sub.max(axis=-1)
    scale, offset = (high - low) / 15, -low
    d = (scale.max(axis=-1) / 63).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
        mn = np.clip(np.nan_to_num(np.rint(offset / dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
        step = (d.astype(np.float32)[:, None] * sc)[..., None]
        levels = np.nan_to_num((sub + (dmin.astype(np.float32)[:, None] * mn)[..., None]) / step)
    levels = np.clip(np.rint(levels), 0, 15).astype(np.uint8)
    packed = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=-1,
    )
    runs = levels.reshape(-1, 4, 2, 32)
    qs = (runs[:, :, 0, :] | (runs[:, :, 1, :] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), packed, qs], axis=-1)
    return blocks.reshape(values.shape[0], -1)


def quantize_q6_k(values):
    """``values`` (float32, rows x a multiple of 256) as Q6_K blocks: per 16 values an int8 scale under the block's
    float16 d, 6-bit levels (level - 32). Plain rounding; tested against ``gguf.quants.dequantize``."""
    import numpy as np

    sub = values.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31
    d = (scale.max(axis=-1) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.rint(scale / d.astype(np.float32)[:, None])), -128, 127).astype(np.int8)
        levels = np.nan_to_num(sub / (d.astype(np.float32)[:, None] * sc)[..., None])
    q = (np.clip(np.rint(levels), -32, 31) + 32).astype(np.uint8).reshape(-1, 256)
    low, high = (q & 0x0F).reshape(-1, 2, 2, 64), (q >> 4).reshape(-1, 2, 4, 32)
    ql = (low[:, :, 0, :] | (low[:, :, 1, :] << 4)).reshape(-1, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d[:, None].view(np.uint8)], axis=-1)
    return blocks.reshape(values.shape[0], -1)


def rewrite_gguf(source, destination, new_type):
    """``source`` again with each tensor in ``new_type(name, type, row length)`` (None: as it is), its metadata
    unchanged; ``gguf``'s quantizers, and the two above for Q4_K and Q6_K."""
    import gguf
    from gguf.quants import dequantize, quantize

    own = {gguf.GGMLQuantizationType.Q4_K: quantize_q4_k, gguf.GGMLQuantizationType.Q6_K: quantize_q6_k}
    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(destination), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    for tensor in reader.tensors:
        kind = new_type(tensor.name, tensor.tensor_type, int(tensor.shape[0]))
        if kind is None:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
        else:
            values = dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, own[kind](values) if kind in own else quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


def differences_from_llama_cpp(source, folder) -> dict:
    """For every quantized tensor of the GGUF ``source``: (its GGML type, the largest |imported weight - llama.cpp's
    dequantization|, and that difference in levels of its MLX group), the imported folder's weights read back
    with ``mx.dequantize`` at the widths its config gives, Q/K rows compared in the importer's order."""
    import gguf
    import mlx.core as mx
    import numpy as np
    from gguf.quants import dequantize

    from runner.gguf import FLOAT_TYPES, mlx_name, unpermute_rows

    config = json.loads((Path(folder) / "config.json").read_text())
    weights = mx.load(str(Path(folder) / "model.safetensors"))
    quantization = config["quantization"]
    found = {}
    for tensor in gguf.GGUFReader(str(source)).tensors:
        if tensor.tensor_type.name in FLOAT_TYPES:
            continue
        expected = dequantize(tensor.data, tensor.tensor_type)
        if ".attn_q." in tensor.name:
            expected = unpermute_rows(expected, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            expected = unpermute_rows(expected, config["num_key_value_heads"])
        base = mlx_name(tensor.name).removesuffix(".weight")
        bits = quantization.get(base, quantization)["bits"]
        scales = weights[f"{base}.scales"]
        got = mx.dequantize(weights[f"{base}.weight"], scales, weights[f"{base}.biases"], group_size=32, bits=bits)
        difference = np.abs(np.array(got.astype(mx.float32)) - expected)
        level = np.repeat(np.abs(np.array(scales.astype(mx.float32))), 32, axis=-1)
        found[tensor.name] = (
            tensor.tensor_type.name,
            float(difference.max()),
            float((difference / np.maximum(level, 1e-30)).max()),
        )
    return found


def tiny_gguf(destination, vocabulary, architecture: str = "llama", *, chat_template: str | None = None, seed: int = 0):
    """A GGUF of a random mlx-lm model of ``architecture`` (2 layers, hidden 64; Q8_0 projections, F16 the
    embedding) written as llama.cpp writes one (``gguf_like_llama_cpp``), with the vocabulary, special tokens,
    flags and chat template of the vocabulary-only GGUF ``vocabulary`` (llama.cpp's ``ggml-vocab-*.gguf``), as a
    real model of that vocabulary's family carries them."""
    import importlib

    import gguf
    import mlx.core as mx

    reader = gguf.GGUFReader(str(vocabulary))
    config = {
        "model_type": architecture,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
        "max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(redrawn(model.parameters()))
    return gguf_like_llama_cpp(model, config, reader, destination, chat_template=chat_template, quantized=True)


def redrawn(parameters):
    """Every parameter drawn again from N(0, 0.2), norms around one: no zero biases or unit norms, which would let
    a misplaced tensor go unseen."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    def draw(path, array):
        values = mx.random.normal(array.shape) * 0.2
        return 1 + values * 0.5 if path.endswith("norm.weight") or "layernorm" in path else values

    return tree_map_with_path(draw, parameters)


def gguf_like_llama_cpp(
    model, config: dict, vocabulary, destination, *, chat_template: str | None = None, quantized: bool = False
):
    """``model`` (an mlx-lm model, Hugging Face's layout) written to GGUF as llama.cpp's ``convert_hf_to_gguf.py``
    writes it: tensor names from ``gguf``'s own name map, llama's Q/K rows permuted for llama.cpp's RoPE
    (``LlamaModel.permute``), Gemma's norms stored as 1 + weight (``Gemma2Model`` / ``Gemma3Model``), the
    architecture's hyperparameters under its keys, and the tokenizer (and chat
    template, unless ``chat_template`` replaces it) of ``vocabulary``, a ``gguf.GGUFReader`` of a vocabulary-only
    GGUF. Tensors are float32, or with ``quantized`` the projections Q8_0 and the embedding F16."""
    import gguf
    import mlx.core as mx
    import numpy as np
    from gguf.quants import quantize
    from mlx.utils import tree_flatten

    arch = {"gemma3_text": "gemma3"}.get(config["model_type"], config["model_type"])
    kind = next(kind for kind, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = gguf.get_tensor_name_map(kind, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(destination), arch)
    for name, field in vocabulary.fields.items():
        if name.startswith("tokenizer.") and not (name == "tokenizer.chat_template" and chat_template is not None):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
        writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(config.get("sliding_window", 4096))
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.get("attn_logit_softcapping", 50.0))
        writer.add_final_logit_softcapping(config.get("final_logit_softcapping", 30.0))

    def permute(weights, n_head):  # convert_hf_to_gguf.py's LlamaModel.permute
        return (
            weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    mx.eval(model.parameters())
    for name, array in tree_flatten(model.parameters()):
        data = np.array(array.astype(mx.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = permute(data, kv_heads)
        elif arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quantized and name.endswith("_proj.weight"):
            writer.add_tensor(
                gguf_name, quantize(data, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
        elif quantized and name.endswith("embed_tokens.weight"):
            writer.add_tensor(gguf_name, data.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return destination


def mlx_lm_greedy(model, prompt_ids, max_tokens: int) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens, and at each step the gap between its two most likely tokens' log-probabilities."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, gaps = [], []
    for token, logprobs in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        second, first = mx.sort(logprobs)[-2:].tolist()
        tokens.append(token)
        gaps.append(first - second)
    return tokens, gaps


def on_a_terminal(args: list[str], env: dict, steps=(), timeout: float = 120) -> tuple[int, str]:
    """Run ``args`` with a pseudo-terminal as its stdin, stdout and stderr (as a person at a terminal runs it):
    for each ``(text, reply)`` of ``steps``, wait until ``text`` has appeared, then type ``reply``; then read to
    the end. Returns the exit status and everything it wrote, escape sequences included."""
    import os
    import pty
    import select
    import subprocess
    import time

    master, slave = pty.openpty()
    process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout

    def read_until(done) -> None:
        while not done() and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # the other end closed: the process has exited
                    return
                if not data:
                    return
                out.extend(data)

    try:
        for text, reply in steps:
            read_until(lambda text=text: text.encode() in out)
            os.write(master, reply.encode())
        read_until(lambda: False)
        return process.wait(max(1.0, deadline - time.monotonic())), out.decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)


def queued_and_not(monkeypatch, drafter_class, run) -> dict:
    """``run()`` twice: the drafter queueing the next round's first draft with each verification
    (``Drafter.queue_next``), and not. {queueing: (what ``run`` returned, the proposals that took a queued draft)}."""
    from runner.drafting import drafters

    used = []
    propose = drafter_class.propose

    def spy(self, context, k, params, key):
        # A queued first draft is ready for exactly this context (the draft model's after all of it, an MTP
        # layer's or a head's after the pending token's position).
        used.append(self._next is not None and self._next[0] in (len(context), len(context) - 1))
        return propose(self, context, k, params, key)

    monkeypatch.setattr(drafter_class, "propose", spy)
    runs = {}
    for queue in (True, False):
        monkeypatch.setattr(drafters, "QUEUE_NEXT_DRAFT", queue)
        used.clear()
        runs[queue] = run(), sum(used)
    return runs
