"""Build tiny random-weight Qwen2-VL and Qwen2.5-VL models (mlx-vlm's ``qwen2_vl``, ``qwen2_5_vl``) for vision tests.

    python models/train_vision_qwen2vl.py [OUT_PARENT]

Writes ``models/vision/qwen2_vl/`` and ``models/vision/qwen2_5_vl/`` by default, in Qwen2-VL-2B-Instruct's and
Qwen2.5-VL-3B-Instruct's layouts shrunk:

* vision: Qwen2-VL's ViT (2 blocks, embed 32, 2 heads, LayerNorm, QuickGELU MLP) and Qwen2.5-VL's (2 blocks,
  hidden 32, 2 heads, RMSNorm, SwiGLU, window attention with block 1 full, as ``fullatt_block_indexes``); both
  patch 14, temporal patch 2, ``spatial_merge_size`` 2 (2x2 patches -> 1 token), so a 112x112 image is 8x8
  patches and 16 ``<|image_pad|>`` tokens between ``<|vision_start|>`` and ``<|vision_end|>``;
* text: Qwen2 (q/k/v with bias), hidden 64, 2 layers, 2 heads / 1 kv head (head_dim 32), an untied head as
  the 7B ones have (tied, a random model this small repeats its last token), and M-RoPE: ``rope_scaling``
  ``{"type": "mrope", "mrope_section": [4, 6, 6]}`` (the real [16, 24, 24] for head_dim 128, shrunk),
  so an image's tokens take (time, row, column) positions and the text after an image continues from the
  largest position + 1, not from its index; q and k projections scaled up 6x from the default init, so that
  positions change the answer;
* config.json as the real ones: the text keys at the top level (``model_type`` ``qwen2_vl`` / ``qwen2_5_vl``),
  ``vision_config``, ``image_token_id`` and ``vision_start_token_id``;
* SmolLM2's tokenizer (it has ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``) plus Qwen's vision tokens
  (``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``: ids
  49152-49156), Qwen2-VL's real chat template and preprocessor configuration (``Qwen2VLImageProcessor``, CLIP
  mean/std, ``min_pixels`` 3136, ``max_pixels`` 12544 so an image is at most 112x112's area).

No vision model can be fetched here: random weights in the real architectures, stored float32 under mlx-vlm's
module names. It checks itself: mlx-vlm loads each strictly with its own processor (numpy, offline), an image
expands to its ``<|image_pad|>`` run, the positions mlx-vlm computes put the text after an image past the
image's index (the delta the runner must add is not 0), and ``mlx_vlm.generate`` answers greedily with tokens
that another image changes and that plain positions would change (mlx-lm's ``qwen2`` over the same arrays, fed
the same embeddings at their indices): a server that ignored M-RoPE could not pass the tests. Runs on the CPU in
seconds.
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
from vision_build import BASE_VOCAB, extend_tokenizer, greedy, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "vision"

SEED = 0
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"  # SmolLM2's ids 0, 1, 2
VISION_START, VISION_END, VISION_PAD = "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
ADDED = [VISION_START, VISION_END, VISION_PAD, IMAGE_PAD, VIDEO_PAD]  # Qwen2's order (151652-151656 there)
TOKEN_IDS = {t: BASE_VOCAB + i for i, t in enumerate(ADDED)}
VOCAB_SIZE = BASE_VOCAB + len(ADDED)  # 49157
EOS_IDS = [2, 0]  # <|im_end|>, <|endoftext|> (Qwen2-VL's generation_config)

PATCH_SIZE = 14
MERGE = 2
MAX_PIXELS = 112 * 112
IMAGE_TOKENS = (112 // PATCH_SIZE // MERGE) ** 2  # 16 for a 112x112 image
ATTENTION_SCALE = 6.0  # the text model's q and k projections, scaled up from the default init

# Qwen2-VL-7B-Instruct's chat template (Qwen2.5-VL's is the same).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT_KEYS = {
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 32768,
    "max_window_layers": 2,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB_SIZE,
    "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
}
COMMON = {
    "bos_token_id": 0,
    "eos_token_id": 2,
    "vision_start_token_id": TOKEN_IDS[VISION_START],
    "vision_end_token_id": TOKEN_IDS[VISION_END],
    "vision_token_id": TOKEN_IDS[VISION_PAD],
    "image_token_id": TOKEN_IDS[IMAGE_PAD],
    "video_token_id": TOKEN_IDS[VIDEO_PAD],
    "torch_dtype": "float32",
    **TEXT_KEYS,
}
FAMILIES = {
    "qwen2_vl": {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        **COMMON,
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "mlp_ratio": 4,
            "num_heads": 2,
            "in_chans": 3,
            "hidden_size": 64,  # the merger's output: the text model's hidden size
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE,
            "spatial_patch_size": PATCH_SIZE,
            "temporal_patch_size": 2,
        },
    },
    "qwen2_5_vl": {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        **COMMON,
        "vision_config": {
            "depth": 2,
            "hidden_act": "silu",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_chans": 3,
            "out_hidden_size": 64,
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE,
            "spatial_patch_size": PATCH_SIZE,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
        },
    },
}
PREPROCESSOR_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": MAX_PIXELS,
    "patch_size": PATCH_SIZE,
    "temporal_patch_size": 2,
    "merge_size": MERGE,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
}


def build_tokenizer(out: Path, processor_class: str) -> None:
    decoder = extend_tokenizer(out, ADDED)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 32768,
            "processor_class": processor_class,
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
        },
    )
    write_json(out / "special_tokens_map.json", {"eos_token": IM_END, "pad_token": ENDOFTEXT})
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": EOS_IDS, "do_sample": False})


def make_model(config: dict):
    """mlx-vlm's model for ``config`` with deterministic random float32 weights."""
    import importlib

    family = importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    mx.random.seed(SEED)
    cfg = family.ModelConfig.from_dict(dict(config))
    cfg.text_config = family.TextConfig.from_dict(cfg.text_config)
    cfg.vision_config = family.VisionConfig.from_dict(config["vision_config"])
    model = family.Model(cfg)
    model.set_dtype(mx.float32)
    # Sharper attention than the default init gives (its scores are near uniform, so where a token sits would
    # hardly change the answer): positions must matter for a test of them to mean anything.
    for layer in model.language_model.model.layers:
        for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj):
            projection.weight = projection.weight * ATTENTION_SCALE
    mx.eval(model.parameters())
    return model


def build(out: Path, name: str) -> None:
    config = FAMILIES[name]
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out, "Qwen2_5_VLProcessor" if name == "qwen2_5_vl" else "Qwen2VLProcessor")
    model = make_model(config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", config)
    processor = {**PREPROCESSOR_CONFIG}
    if name == "qwen2_5_vl":
        processor["processor_class"] = "Qwen2_5_VLProcessor"
    write_json(out / "preprocessor_config.json", processor)
    print(f"wrote {out} ({sum(v.size for v in weights.values()):,} parameters)")


def gradient_image(width: int = 112, height: int = 112):
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), ((x // 8 + y // 8) % 2) * 255], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def verify(out: Path, name: str) -> None:
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(out))
    print(f"[{name}] loaded {type(model).__module__}.{type(model).__name__} / {type(processor).__name__}")
    tokenizer = processor.tokenizer
    for t, want in TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(t) == want, (t, tokenizer.convert_tokens_to_ids(t), want)
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    # mlx-vlm lays the image out after the text (the runner before it, as the template's own order of parts)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == 1, prompt
    image = gradient_image()
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(TOKEN_IDS[IMAGE_PAD]) == IMAGE_TOKENS, ids
    positions, deltas = model.language_model.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"])
    delta = int(deltas.reshape(-1)[0])
    assert delta == -(IMAGE_TOKENS - 4), delta  # 16 tokens on a 4x4 grid span 4 positions: 12 fewer
    tokens = []
    for picture in (image, gradient_image(112, 56).transpose(0)):
        result = mlx_vlm.generate(model, processor, prompt, image=[picture], max_tokens=12, temperature=0.0)
        tokens.append(list(result.token_ids))
        print(f"[{name}] {tuple(picture.size)}: {result.prompt_tokens} prompt tokens; {tokens[-1]} {result.text!r}")
    assert tokens[0] != tokens[1], tokens
    plain = plain_positions(model, config_of(out), inputs, len(tokens[0]))
    print(f"[{name}] plain positions instead: {plain}")
    assert plain != tokens[0], plain
    print(f"[{name}] rope delta after one image: {delta}; another image and plain positions change the answer")


def config_of(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def plain_positions(model, config: dict, inputs, n: int) -> list[int]:
    """Greedy tokens of mlx-lm's qwen2 over mlx-vlm's language-model arrays, fed the prompt's embeddings (the
    image's features in place) at positions 0..L-1: what a server that ignored M-RoPE would answer."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    text_config = {k: v for k, v in config.items() if k != "vision_config"}
    text_config["model_type"] = "qwen2"
    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    text.load_weights(list(tree_flatten(model.language_model.parameters())), strict=True)
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    embeds = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **extra).inputs_embeds
    cache = make_prompt_cache(text)
    logits = text(inputs["input_ids"], cache=cache, input_embeddings=embeds)[:, -1, :]
    return greedy(logits, lambda token: text(mx.array([[token]]), cache=cache)[:, -1, :], n)


if __name__ == "__main__":
    started = time.perf_counter()
    for name in FAMILIES:
        build(OUT / name, name)
        verify(OUT / name, name)
    print(f"done in {time.perf_counter() - started:.1f}s")
