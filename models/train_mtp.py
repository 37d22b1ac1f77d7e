"""Build three tiny random-weight checkpoints that carry multi-token-prediction (MTP) layers, for runner.drafting.mtp's
tests.

    python models/train_mtp.py [OUT_DIR]

Writes, under ``models/mtp/`` by default, SmolLM2's tokenizer (49152 tokens) and float32 weights:

* ``deepseek_v3/``: mlx-lm's ``deepseek_v3`` shrunk (hidden 64, 2 layers: one dense, one MoE with 4 routed experts
  and a shared one, MLA with kv_lora_rank 16), and its MTP layer as DeepSeek-V3's checkpoint lays it out:
  ``model.layers.2`` (= ``num_hidden_layers``; config ``num_nextn_predict_layers`` 1) with the decoder layer's
  weights plus ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``shared_head.head`` and ``embed_tokens``
  (copies of the target's). Every layer in Hugging Face's names (``self_attn.kv_b_proj``, ``mlp.experts.N``), as
  the original checkpoint has them, which mlx-lm's sanitize converts.
* ``glm4_moe/``: mlx-lm's ``glm4_moe`` shrunk (GLM-4.5's architecture: GQA with q/k norms and partial rotary, one
  dense layer then MoE), its MTP layer laid out as GLM-4.5's checkpoint has it: the same names as DeepSeek-V3's
  (``model.layers.2``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, experts as ``mlp.experts.N``).
* ``qwen3_5/``: mlx-lm's ``qwen3_5`` text model (hybrid: Gated DeltaNet and gated full attention, the vision
  tests' text config without the vision tower), in mlx's layout, and its MTP layer as Qwen3.5 / Qwen3-Next name it:
  ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.layers.0`` (a full-attention
  decoder layer), ``mtp.norm`` (config ``mtp_num_hidden_layers`` 1).

Random weights: the MTP layers' drafts are rarely right. They check loading, drafting, caches and rewinds; they say
nothing about a real model's acceptance. So DeepSeek-V3's and Qwen3.5's each also get a ``*_trained`` copy whose
MTP layer was trained here (60 steps, the target frozen) on the target's own greedy answer to tests/test_mtp.py's
prompt: there its drafts are kept, so the tests see accepted drafts too (an overfit layer: nothing about acceptance
elsewhere either). Runs on the CPU in under a minute.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "mtp"
SMOLLM2 = ROOT / "models" / "smollm2"
VOCAB = 49152
SEED = 0

DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

GLM = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "use_qk_norm": True,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "routed_scaling_factor": 1.0,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}

QWEN_TEXT = {
    "model_type": "qwen3_5_text",
    "attention_bias": False,
    "attn_output_gate": True,
    "eos_token_id": 2,
    "full_attention_interval": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 4096,
    "mtp_num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB,
    "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25, "type": "default"},
}
QWEN = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "text_config": QWEN_TEXT,
}


def randomize(module, scale: float = 0.08) -> None:
    """Every weight drawn anew (norms near 1, biases of the router 0): a model whose answer depends on its input."""
    params = []
    for name, value in tree_flatten(module.parameters()):
        if name.endswith("e_score_correction_bias"):
            new = mx.zeros(value.shape)
        elif "norm" in name and value.ndim == 1:
            new = 1.0 + 0.1 * mx.random.normal(value.shape)
        elif name.endswith("A_log") or name.endswith("dt_bias"):
            new = value
        else:
            new = scale * mx.random.normal(value.shape)
        params.append((name, new.astype(mx.float32)))
    module.load_weights(params)
    mx.eval(module.parameters())


def copy_tokenizer(out: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SMOLLM2 / name, out / name)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def hf_layer(prefix: str, weights: dict, config: dict) -> dict:
    """One deepseek_v3 or glm4_moe layer's mlx-lm weights under Hugging Face's names (experts.N; DeepSeek's MLA
    kv_b_proj)."""
    out = {}
    for name, value in weights.items():
        if ".self_attn.embed_q." in name or ".self_attn.unembed_out." in name:
            continue
        if ".mlp.switch_mlp." in name:
            projection = name.split(".mlp.switch_mlp.")[1]  # gate_proj.weight
            for e in range(value.shape[0]):
                out[name.split(".mlp.switch_mlp.")[0] + f".mlp.experts.{e}.{projection}"] = value[e]
            continue
        out[name] = value
    if f"{prefix}.self_attn.embed_q.weight" not in weights:
        return out  # no MLA (GLM)
    heads, nope, v_dim = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
    wk = weights[f"{prefix}.self_attn.embed_q.weight"]  # (heads, kv_lora, nope)
    wv = weights[f"{prefix}.self_attn.unembed_out.weight"]  # (heads, v_dim, kv_lora)
    kv_b = mx.concatenate([wk.swapaxes(-1, -2), wv], axis=1)  # (heads, nope + v_dim, kv_lora)
    out[f"{prefix}.self_attn.kv_b_proj.weight"] = kv_b.reshape(heads * (nope + v_dim), -1)
    return out


def build_deepseek(out: Path, family: str = "deepseek_v3") -> None:
    """DeepSeek-V3's layout (``family`` deepseek_v3) or GLM-4.5's, which names its MTP layer the same way (glm4_moe)."""
    import importlib

    from runner.drafting.mtp import DeepseekMTP

    out.mkdir(parents=True)
    copy_tokenizer(out)
    config = dict(DEEPSEEK if family == "deepseek_v3" else GLM)
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict(config)
    model = module.Model(args)
    randomize(model)
    index = config["num_hidden_layers"]
    layer_class = module.DeepseekV3DecoderLayer if family == "deepseek_v3" else module.DecoderLayer
    mtp = DeepseekMTP(layer_class, args, index)
    randomize(mtp)
    flat = dict(tree_flatten(model.parameters()))
    weights = {k: v for k, v in flat.items() if not k.startswith("model.layers.")}
    for i in range(index):
        prefix = f"model.layers.{i}"
        weights.update(hf_layer(prefix, {k: v for k, v in flat.items() if k.startswith(prefix + ".")}, config))
    prefix = f"model.layers.{index}"
    layer = {}
    for name, value in tree_flatten(mtp.parameters()):
        layer[f"{prefix}.{name.removeprefix('layer.')}"] = value
    weights.update(hf_layer(prefix, layer, config))
    weights[f"{prefix}.embed_tokens.weight"] = flat["model.embed_tokens.weight"]
    weights[f"{prefix}.shared_head.head.weight"] = flat["lm_head.weight"]
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "pt"})
    write_json(out / "config.json", config)
    print(f"wrote {out} ({sum(v.size for v in weights.values()):,} parameters, {len(layer)} MTP tensors)")


def build_qwen(out: Path) -> None:
    from mlx_lm.models import qwen3_5

    from runner.drafting.mtp import QwenMTP

    out.mkdir(parents=True)
    copy_tokenizer(out)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(json.loads(json.dumps(QWEN))))
    randomize(model)
    mtp = QwenMTP(qwen3_5.DecoderLayer, model.language_model.args)
    randomize(mtp)
    weights = dict(tree_flatten(model.parameters()))
    weights.update({f"mtp.{k}": v for k, v in tree_flatten(mtp.parameters())})
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", QWEN)
    print(f"wrote {out} ({sum(v.size for v in weights.values()):,} parameters)")


def verify(out: Path) -> None:
    """Each loads through the runner's loader with its MTP layer, and its MTP layer drafts."""
    from runner.drafting.mtp import HiddenModel, MTPDrafter
    from runner.loading.load import load_model
    from runner.sampling import SamplingParams

    for name in ("deepseek_v3", "glm4_moe", "qwen3_5"):
        loaded = load_model(out / name, "float32", row_padding=False)
        assert loaded.mtp is not None, name
        drafter = MTPDrafter(loaded.model, loaded.mtp)
        target = HiddenModel(loaded.model, drafter.hidden)
        prompt = [1, 2, 3, 4, 5, 6]
        cache = target.make_cache()
        logits = target(mx.array(prompt[:-1])[None], cache=cache)
        plain = loaded.model(mx.array(prompt[:-1])[None])
        assert mx.allclose(logits, plain, atol=1e-5).item(), name
        proposal = drafter.propose(prompt, 3, SamplingParams(temperature=0.0), None)
        print(f"{name}: MTP drafts {proposal.tokens.tolist()} after {prompt}")


TRAIN_PROMPT = "The for statement is used to iterate over the elements of a sequence"  # tests/test_mtp.py's
TRAIN_TOKENS = 64
TRAIN_STEPS = 60


def mtp_tensors(name: str, mtp, config: dict) -> dict:
    """An MTP module's weights as the checkpoint names them."""
    flat = dict(tree_flatten(mtp.parameters()))
    if name == "qwen3_5":
        return {f"mtp.{k}": v for k, v in flat.items()}
    prefix = f"model.layers.{config['num_hidden_layers']}"
    return hf_layer(prefix, {f"{prefix}.{k.removeprefix('layer.')}": v for k, v in flat.items()}, config)


def train(out: Path, name: str) -> None:
    """``{name}_trained``: the same target, its MTP layer trained (the target frozen) to predict token i+2 of the
    target's own greedy answer to TRAIN_PROMPT from (h_i, token i+1): a layer whose drafts are mostly kept there,
    so that the tests see accepted drafts (random weights keep none). Seconds on the CPU."""
    import mlx.nn as nn
    import mlx.optimizers as optim

    from common.settings import RunnerSettings
    from runner.drafting.mtp import HiddenModel, MTPDrafter
    from runner.engine import Engine
    from runner.request import GenerationRequest

    engine = Engine.load(out / name, settings=RunnerSettings(dtype="float32", drafter="none"))
    request = GenerationRequest(prompt=TRAIN_PROMPT, max_tokens=TRAIN_TOKENS, ignore_eos=True, cache_prompt=False)
    prompt = engine.prepare(request).prompt_ids
    answer = [t for r in engine.generate(request) for t in r.token_ids]
    sequence = list(prompt) + answer
    target, mtp = engine.target.model, engine.target.mtp
    drafter = MTPDrafter(target, mtp)
    model = HiddenModel(target, drafter.hidden)
    model(mx.array(sequence[:-1])[None], cache=model.make_cache())
    hidden = mx.stop_gradient(mx.concatenate([drafter.hidden[i] for i in range(len(sequence) - 2)], axis=1))
    following = mx.array(sequence[1:-1])[None]
    labels = mx.array(sequence[2:])[None]

    def loss_fn(module):
        x = module.decode(module.project(drafter.embed(following), hidden), None)
        logits = drafter.head(module.final_norm(x))
        return nn.losses.cross_entropy(logits, labels).mean()

    optimizer = optim.Adam(learning_rate=1e-2)
    step = nn.value_and_grad(mtp, loss_fn)
    for i in range(TRAIN_STEPS):
        loss, grads = step(mtp)
        optimizer.update(mtp, grads)
        mx.eval(mtp.parameters(), optimizer.state)
    print(f"{name}: MTP layer trained {TRAIN_STEPS} steps on {len(sequence)} tokens, loss {loss.item():.3f}")
    config = json.loads((out / name / "config.json").read_text())
    weights = mx.load(str(out / name / "model.safetensors"))
    ours = mtp_tensors(name, mtp, config)
    kept = {k: v for k, v in weights.items() if k not in ours}
    assert len(kept) + len(ours) == len(weights), "the trained layer's names differ from the checkpoint's"
    trained = out / f"{name}_trained"
    shutil.copytree(out / name, trained)
    layout = "mlx" if name == "qwen3_5" else "pt"
    mx.save_safetensors(str(trained / "model.safetensors"), {**kept, **ours}, metadata={"format": layout})


if __name__ == "__main__":
    started = time.perf_counter()
    mx.random.seed(SEED)
    if OUT.exists():
        shutil.rmtree(OUT)
    build_deepseek(OUT / "deepseek_v3")
    build_deepseek(OUT / "glm4_moe", "glm4_moe")
    build_qwen(OUT / "qwen3_5")
    verify(OUT)
    train(OUT, "deepseek_v3")
    train(OUT, "qwen3_5")
    print(f"done in {time.perf_counter() - started:.1f} s")
