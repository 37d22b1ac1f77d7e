"""Build tiny random-weight Qwen3-VL models (mlx-vlm's ``qwen3_vl``, ``qwen3_vl_moe``: M-RoPE and deepstack).

    python models/train_vision_qwen3vl.py [OUT_PARENT]

Writes ``models/vision/qwen3_vl/`` and ``models/vision/qwen3_vl_moe/`` by default, in Qwen3-VL-4B-Instruct's
layout shrunk (the MoE one as Qwen3-VL-30B-A3B's text: 4 experts, 2 per token, every layer sparse):

* text (``text_config``, ``model_type`` ``qwen3_vl_text``: Qwen3 with q/k norms): hidden 64, 4 layers, 2 heads /
  1 kv head, head_dim 32, untied head (tied, a random model this small repeats its last token), interleaved
  M-RoPE (``rope_scaling`` ``{"mrope_interleaved": true, "mrope_section": [6, 5, 5], "rope_type": "default"}``:
  the real [24, 20, 20] for head_dim 128, shrunk); q and k projections scaled up 6x from the default init, so
  that positions change the answer;
* vision: Qwen3-VL's ViT, 3 blocks, hidden 32, 2 heads, patch 16, temporal patch 2, ``spatial_merge_size`` 2,
  learned position embeddings for an 8x8 grid, and deepstack: the features of blocks 0 and 1
  (``deepstack_visual_indexes``, the real [5, 11, 17] of 24, shrunk), each through its own merger, are added to
  the hidden states of the image's tokens after text layers 0 and 1. A 128x128 image is 16 ``<|image_pad|>``;
* SmolLM2's tokenizer plus Qwen's vision tokens, a chat template that lays out messages, images and the
  generation prompt as Qwen3-VL-Instruct's does (no system prompt unless given, images as
  ``<|vision_start|><|image_pad|><|vision_end|>`` in the order of the parts; its tool-call part left out), and
  a Qwen2-VL style image processor at 128x128 px (mean and std 0.5, as Qwen3-VL's).

No vision model can be fetched here: random weights in the real architecture, float32. It checks itself: mlx-vlm
loads it strictly with its own processor, an image expands to 16 ``<|image_pad|>`` with the text after it 12
positions below its index, mlx-vlm computes two deepstack layers of features, and ``mlx_vlm.generate``'s greedy
tokens change with another image, with plain positions, and without the deepstack features (mlx-lm's ``qwen3``
over the same arrays fed the merged embeddings at their M-RoPE positions, with nothing added after its first
layers): a server that dropped either would fail the tests. Runs on the CPU in seconds.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_vision_qwen2vl import ATTENTION_SCALE, gradient_image  # noqa: E402
from train_vision_qwen3_5 import PREPROCESSOR_CONFIG  # noqa: E402
from vision_build import BASE_VOCAB, extend_tokenizer, greedy, qwen_layout, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "vision"

SEED = 0
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
TOKEN_IDS = {t: BASE_VOCAB + i for i, t in enumerate(SPECIAL)}
VOCAB_SIZE = BASE_VOCAB + len(SPECIAL)  # 49157
IMAGE_TOKENS = 16

CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Picture ' ~ image_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content.type == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}{{- 'Video ' ~ video_count.value ~ ': ' }}{%- endif %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TEXT_CONFIG = {
    "model_type": "qwen3_vl_text",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 32768,
    "num_attention_heads": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [6, 5, 5], "rope_type": "default"},
    "rope_theta": 5000000,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
}
VISION_CONFIG = {
    "model_type": "qwen3_vl",
    "deepstack_visual_indexes": [0, 1],
    "depth": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 32,
    "in_channels": 3,
    "intermediate_size": 64,
    "num_heads": 2,
    "num_position_embeddings": 64,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": TOKEN_IDS["<|image_pad|>"],
    "video_token_id": TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
}

MOE_CONFIG = {
    **CONFIG,
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "text_config": {
        **TEXT_CONFIG,
        "model_type": "qwen3_vl_moe_text",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
    "vision_config": {**VISION_CONFIG, "model_type": "qwen3_vl_moe"},
}
FAMILIES = {"qwen3_vl": CONFIG, "qwen3_vl_moe": MOE_CONFIG}


def build_tokenizer(out: Path) -> None:
    decoder = extend_tokenizer(out, SPECIAL)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 32768,
            "processor_class": "Qwen3VLProcessor",
            "tokenizer_class": "Qwen2Tokenizer",
        },
    )
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [2, 0], "do_sample": False})


def make_model(config: dict):
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(SEED)
    model = family.Model(family.ModelConfig.from_dict(json.loads(json.dumps(config))))
    model.set_dtype(mx.float32)
    for layer in model.language_model.model.layers:  # sharper attention: positions must change the answer
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * ATTENTION_SCALE
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * ATTENTION_SCALE
    mx.eval(model.parameters())
    return model


def build(out: Path, config: dict) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    model = make_model(config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", config)
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    print(f"wrote {out} ({sum(v.size for v in weights.values()):,} parameters)")


def without(model, inputs, n: int, positions: bool) -> list[int]:
    """Greedy tokens of mlx-vlm's own language model fed the merged embeddings without the deepstack features,
    at mlx-vlm's M-RoPE positions (``positions``) or at plain ones: what a server that dropped either would give."""
    from mlx_lm.models.cache import make_prompt_cache

    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    features = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **extra)
    language = model.language_model
    cache = make_prompt_cache(language)
    kwargs = {"position_ids": features.position_ids, "rope_deltas": features.rope_deltas} if positions else {}
    if not positions:
        length = inputs["input_ids"].shape[1]
        kwargs = {"position_ids": mx.broadcast_to(mx.arange(length)[None, None], (3, 1, length))}
    logits = language(inputs["input_ids"], features.inputs_embeds, cache=cache, **kwargs).logits[:, -1, :]
    return greedy(logits, lambda token: language(mx.array([[token]]), cache=cache).logits[:, -1, :], n)


def verify(out: Path) -> None:
    import mlx_vlm

    image = gradient_image(128, 128)
    model, processor, prompt, inputs = qwen_layout(
        out, "<|im_start|>assistant\n", TOKEN_IDS["<|image_pad|>"], IMAGE_TOKENS, image
    )
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    features = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **extra)
    assert len(features.deepstack_visual_embeds) == 2, features.deepstack_visual_embeds
    delta = int(features.rope_deltas.reshape(-1)[0])
    assert delta == -(IMAGE_TOKENS - 4), delta
    tokens = []
    for picture in (image, gradient_image(128, 64).transpose(0)):
        result = mlx_vlm.generate(model, processor, prompt, image=[picture], max_tokens=12, temperature=0.0)
        tokens.append(list(result.token_ids))
        print(f"{tuple(picture.size)}: {result.prompt_tokens} prompt tokens; {tokens[-1]} {result.text!r}")
    assert tokens[0] != tokens[1], tokens
    no_deepstack = without(model, inputs, len(tokens[0]), positions=True)
    plain = without(model, inputs, len(tokens[0]), positions=False)
    print(f"without deepstack: {no_deepstack}; and at plain positions: {plain}")
    assert no_deepstack != tokens[0] and plain != no_deepstack, (no_deepstack, plain)
    print(f"rope delta after one image: {delta}; another image, no deepstack and plain positions change the answer")


if __name__ == "__main__":
    started = time.perf_counter()
    for name, config in FAMILIES.items():
        build(OUT / name, config)
        verify(OUT / name)
    print(f"done in {time.perf_counter() - started:.1f}s")
