"""Build a tiny random-weight SmolVLM checkpoint for vision tests.

    python models/train_vision.py

Writes ``models/vision/smolvlm/`` (replacing it if it exists): a
vision-language model of the SmolVLM / Idefics3 family in the layout that
``mlx_vlm.load`` reads (model_type ``smolvlm``, i.e. SmolVLM2's
``SmolVLMForConditionalGeneration``), then loads it back with mlx-vlm and runs
``mlx_vlm.generate`` on a synthetic image as a self-check.

Why random weights: no VLM can be fetched on this machine (the Hugging Face hub
is unreachable), and the point of this checkpoint is not quality but
structure.  It has SmolVLM's real architecture, built from mlx-vlm's own
classes (SigLIP vision tower -> pixel-shuffle connector -> Llama text model),
SmolLM2's real tokenizer extended with SmolVLM-256M-Instruct's added tokens at
their real ids (``<global-img>`` 49152, ``<row_r_col_c>`` 49153-49188,
``<fake_token_around_image>`` 49189, ``<image>`` 49190, reserved tokens
49191-49278, ``<end_of_utterance>`` 49279; vocab 49280), SmolVLM's real image
processor / processor configuration and its public chat template.  Tests can
therefore compare the project's runner token-for-token with mlx-vlm's own
``generate`` on the same prompt and image.

Only the sizes are shrunk; the weights are ~6.6 MB of float32:

* text: llama, hidden 16, 2 layers, 2 heads (1 kv head, head_dim 8),
  intermediate 64, untied lm_head (mlx-vlm's Idefics3 language model always
  has one).  embed_tokens and lm_head over the 49280-token vocabulary are
  almost all of the file, hence the small hidden size.  float32 rather than
  SmolVLM's bfloat16 on purpose: with bf16 logits over a 49k vocabulary a
  random model's top-2 logits often tie to within one bf16 ulp (mlx-vlm even
  takes the argmax of bf16 log-probs), so two correct implementations could
  disagree on greedy tokens; in float32 they do not.
* vision: SigLIP, hidden 32, 2 layers, 2 heads, intermediate 64, patch 16,
  image 128 -> 8x8 = 64 patches; connector pixel shuffle with
  scale_factor 2 -> image_seq_len = 64 / 2**2 = 16 ``<image>`` tokens.
* image processor: ``do_image_splitting`` false, so any image becomes one
  128x128 tile and expands to
  ``<fake_token_around_image><global-img>`` + 16 x ``<image>`` +
  ``<fake_token_around_image>`` in the prompt.

Weights are deterministic (``mx.random.seed(0)``) and are stored under
mlx-vlm's module names (what ``mlx_vlm.convert`` writes), which load strictly.

It then writes ``models/vision/llava/`` the same way: a LLaVA-1.5-style model
(mlx-vlm model_type ``llava``: CLIP vision tower -> linear/GELU/linear
projector -> llama), ~6.5 MB of float32:

* text: llama, hidden 16, 2 layers, 2 heads (1 kv head), intermediate 64,
  untied lm_head; SmolLM2's tokenizer plus llava-hf's added special tokens
  ``<image>`` 49152 (``image_token_index``) and ``<pad>`` 49153, vocab 49154;
  eos SmolLM2's ``<|im_end|>`` (2).
* vision: CLIP, hidden 32, 2 layers, 2 heads, intermediate 64, image 64,
  patch 16 -> CLS + 16 patches; ``vision_feature_layer`` -2 and the
  "default" strategy (CLS dropped) merge 16 features per image.
* processor: llava-1.5's ``CLIPImageProcessor`` configuration at 64x64 and
  ``LlavaProcessor`` settings (patch 16, ``num_additional_image_tokens`` 1,
  "default"), so ``<image>`` expands to 16 ``<image>`` tokens; llava-1.5's
  public chat template ("USER: <image>\n... ASSISTANT:").

Its self-check also decodes with mlx-lm's llama class built from
``text_config`` over mlx-vlm's language-model arrays (the same names).
Runs on the CPU in a few seconds.
"""

from __future__ import annotations

import os

# Nothing here may reach the network: set before transformers / mlx_vlm load.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from vision_build import BASE_VOCAB, extend_tokenizer, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "models" / "vision" / "smolvlm"

SEED = 0
VOCAB_SIZE = 49280  # SmolVLM-256M-Instruct's text vocab

# SmolVLM-256M-Instruct's added tokens, in id order (49152 .. 49279).
GLOBAL_IMG = "<global-img>"
ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
FAKE_IMAGE = "<fake_token_around_image>"
IMAGE = "<image>"
RESERVED = [f"<|reserved_special_token_{i}|>" for i in range(88)]
END_OF_UTTERANCE = "<end_of_utterance>"
ADDED = [GLOBAL_IMG, *ROW_COL, FAKE_IMAGE, IMAGE, *RESERVED, END_OF_UTTERANCE]
assert BASE_VOCAB + len(ADDED) == VOCAB_SIZE
TOKEN_IDS = {tok: BASE_VOCAB + i for i, tok in enumerate(ADDED)}
IMAGE_TOKEN_ID = TOKEN_IDS[IMAGE]  # 49190
EOU_TOKEN_ID = TOKEN_IDS[END_OF_UTTERANCE]  # 49279
FAKE_IMAGE_TOKEN_ID = TOKEN_IDS[FAKE_IMAGE]  # 49189
GLOBAL_IMG_TOKEN_ID = TOKEN_IDS[GLOBAL_IMG]  # 49152
# Tokens that are "special" in SmolVLM's tokenizer (skipped on decode); the
# global / row-col markers are plain added tokens there.
SPECIAL = {FAKE_IMAGE, IMAGE, END_OF_UTTERANCE, *RESERVED}

IMAGE_SIZE = 128
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # 16

TEXT_CONFIG = {
    "architectures": ["VLlama3ForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "rope_interleaved": False,
    "max_position_embeddings": 8192,
    "vocab_size": VOCAB_SIZE,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

VISION_CONFIG = {
    "model_type": "smolvlm_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-06,
    "max_image_size": {"longest_edge": IMAGE_SIZE},
    "size": {"longest_edge": IMAGE_SIZE},
    "tie_word_embeddings": False,
    "use_base_siglip": False,
}

CONFIG = {
    "architectures": ["SmolVLMForConditionalGeneration"],
    "model_type": "smolvlm",
    "image_token_id": IMAGE_TOKEN_ID,
    "scale_factor": SCALE_FACTOR,
    "vocab_size": VOCAB_SIZE,
    "bos_token_id": 1,
    "eos_token_id": EOU_TOKEN_ID,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
    "use_cache": True,
    "torch_dtype": "float32",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
}

# SmolVLM-Instruct's public chat template (also used by SmolVLM-256M-Instruct).
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}"
    "{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}"
    "{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

PREPROCESSOR_CONFIG = {
    "do_convert_rgb": True,
    "do_image_splitting": False,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "SmolVLMImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": IMAGE_SIZE},
    "processor_class": "SmolVLMProcessor",
    "resample": 1,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": IMAGE_SIZE},
}

PROCESSOR_CONFIG = {
    "image_seq_len": IMAGE_SEQ_LEN,
    "processor_class": "SmolVLMProcessor",
}


def build_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer.json plus SmolVLM's added tokens at their real ids."""
    added_tokens_decoder = extend_tokenizer(out, ADDED, special=lambda token: token in SPECIAL)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens_decoder,
            "additional_special_tokens": [FAKE_IMAGE, IMAGE, END_OF_UTTERANCE],
            "bos_token": "<|im_start|>",
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": END_OF_UTTERANCE,
            "extra_special_tokens": {
                "end_of_utterance_token": END_OF_UTTERANCE,
                "fake_image_token": FAKE_IMAGE,
                "global_image_token": GLOBAL_IMG,
                "image_token": IMAGE,
            },
            "legacy": False,
            "model_max_length": 8192,
            "pad_token": "<|im_end|>",
            "processor_class": "SmolVLMProcessor",
            "tokenizer_class": "GPT2Tokenizer",
            "truncation_side": "left",
            "unk_token": "<|endoftext|>",
            "vocab_size": BASE_VOCAB,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [FAKE_IMAGE, IMAGE, END_OF_UTTERANCE],
            "bos_token": "<|im_start|>",
            "eos_token": END_OF_UTTERANCE,
            "pad_token": "<|im_end|>",
            "unk_token": "<|endoftext|>",
        },
    )
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def build_weights(out: Path) -> int:
    """Random weights from mlx-vlm's own SmolVLM classes; returns param count."""
    from mlx_vlm.models import smolvlm

    mx.random.seed(SEED)
    model_config = smolvlm.ModelConfig.from_dict(CONFIG)
    model_config.text_config = smolvlm.TextConfig.from_dict(TEXT_CONFIG)
    model_config.vision_config = smolvlm.VisionConfig.from_dict(VISION_CONFIG)
    model = smolvlm.Model(model_config)
    model.set_dtype(mx.float32)  # already float32; kept explicit
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(v.size for v in weights.values())


def build(out: Path = OUT) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    n_params = build_weights(out)
    write_json(out / "config.json", CONFIG)
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", PROCESSOR_CONFIG)
    print(f"wrote {out.relative_to(ROOT)} ({n_params:,} parameters)")
    for p in sorted(out.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size:>10,d} bytes")


def gradient_image(size: int = 64):
    """Deterministic RGB test image: red/green ramps, blue checker."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack(
        [
            x * 255 // (size - 1),
            y * 255 // (size - 1),
            ((x // 8 + y // 8) % 2) * 255,
        ],
        axis=-1,
    ).astype(np.uint8)
    return Image.fromarray(rgb, "RGB")


def verify(out: Path = OUT) -> None:
    import mlx_vlm
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(out))
    print(
        f"loaded {type(model).__module__}.{type(model).__name__} with "
        f"{type(processor).__module__}.{type(processor).__name__} / "
        f"{type(processor.image_processor).__name__} / "
        f"{type(processor.tokenizer).__name__}"
    )
    tokenizer = processor.tokenizer
    for content, want in TOKEN_IDS.items():
        if content in (GLOBAL_IMG, FAKE_IMAGE, IMAGE, END_OF_UTTERANCE):
            got = tokenizer.convert_tokens_to_ids(content)
            assert got == want, (content, got, want)
    assert model.config.image_token_index == IMAGE_TOKEN_ID
    assert processor.image_seq_len == IMAGE_SEQ_LEN, processor.image_seq_len

    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    print(f"prompt: {prompt!r}")
    assert prompt == "<|im_start|>User:<image>Describe the image.<end_of_utterance>\nAssistant:", prompt

    image = gradient_image()
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    n_image = ids.count(IMAGE_TOKEN_ID)
    print(
        f"processor: {len(ids)} prompt tokens, {n_image} <image> tokens "
        f"(expected {IMAGE_SEQ_LEN}), {ids.count(FAKE_IMAGE_TOKEN_ID)} "
        f"<fake_token_around_image>, {ids.count(GLOBAL_IMG_TOKEN_ID)} <global-img>; "
        f"pixel_values {tuple(inputs['pixel_values'].shape)}"
    )
    print(f"input_ids: {ids}")
    assert n_image == IMAGE_SEQ_LEN
    assert tuple(inputs["pixel_values"].shape) == (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)

    result = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)
    print(
        f"generate: prompt_tokens={result.prompt_tokens} "
        f"generation_tokens={result.generation_tokens} "
        f"finish_reason={result.finish_reason}"
    )
    print(f"generated token ids: {result.token_ids}")
    print(f"generated text: {result.text!r}")
    assert result.prompt_tokens == len(ids)
    assert result.generation_tokens > 0

    # The same greedy decode by hand, through the calls generate makes:
    # Model.get_input_embeddings merges the vision features into the
    # <image> positions, then the language model runs on inputs_embeds.
    from mlx_vlm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    embeds = model.get_input_embeddings(
        inputs["input_ids"],
        inputs["pixel_values"],
        pixel_attention_mask=inputs["pixel_attention_mask"],
    ).inputs_embeds
    logits = model.language_model(inputs["input_ids"], inputs_embeds=embeds, cache=cache).logits[:, -1, :]
    manual, margins = [], []
    for _ in range(len(result.token_ids)):
        top2 = mx.sort(logits[0])[-2:]
        margins.append(float(top2[1] - top2[0]))
        token = int(mx.argmax(logits[0]))
        manual.append(token)
        logits = model.language_model(mx.array([[token]]), cache=cache).logits[:, -1, :]
    print(f"manual greedy token ids: {manual}")
    print(f"min top1-top2 logit margin: {min(margins):.4f}")
    assert manual == result.token_ids, (manual, result.token_ids)


# --------------------------------------------------------------------------
# LLaVA-1.5 (mlx-vlm model_type "llava"): CLIP vision tower -> 2-layer GELU
# projector -> llama, written to models/vision/llava/.
# --------------------------------------------------------------------------

LLAVA_OUT = ROOT / "models" / "vision" / "llava"

# SmolLM2's 49152 tokens plus llava-hf's two added tokens, in llava-hf's order
# (there <image> is 32000 and <pad> 32001 after Llama's 32000).
LLAVA_IMAGE = "<image>"
LLAVA_PAD = "<pad>"
LLAVA_ADDED = [LLAVA_IMAGE, LLAVA_PAD]
LLAVA_VOCAB_SIZE = BASE_VOCAB + len(LLAVA_ADDED)  # 49154
LLAVA_TOKEN_IDS = {tok: BASE_VOCAB + i for i, tok in enumerate(LLAVA_ADDED)}
LLAVA_IMAGE_TOKEN_ID = LLAVA_TOKEN_IDS[LLAVA_IMAGE]  # 49152
LLAVA_PAD_TOKEN_ID = LLAVA_TOKEN_IDS[LLAVA_PAD]  # 49153
# SmolLM2's own special tokens (ids 0, 1, 2 in its vocabulary).
LLAVA_EOS = "<|im_end|>"  # SmolLM2's eos (its config's eos_token_id 2)
LLAVA_EOS_TOKEN_ID = 2
LLAVA_BOS = "<|im_start|>"  # not added to prompts (add_bos_token false)
LLAVA_BOS_TOKEN_ID = 1
LLAVA_UNK = "<|endoftext|>"

LLAVA_IMAGE_SIZE = 64
LLAVA_PATCH_SIZE = 16
# CLIP yields CLS + (64/16)^2 = 17 positions; "default" drops CLS -> 16 merged.
LLAVA_IMAGE_SEQ_LEN = (LLAVA_IMAGE_SIZE // LLAVA_PATCH_SIZE) ** 2  # 16

LLAVA_TEXT_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 16,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 4096,
    "vocab_size": LLAVA_VOCAB_SIZE,
    "bos_token_id": LLAVA_BOS_TOKEN_ID,
    "eos_token_id": LLAVA_EOS_TOKEN_ID,
    "pad_token_id": LLAVA_PAD_TOKEN_ID,
    # explicit: mlx-lm's llama ModelArgs defaults to tied embeddings
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

LLAVA_VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": LLAVA_IMAGE_SIZE,
    "patch_size": LLAVA_PATCH_SIZE,
    "projection_dim": 32,
    "hidden_act": "quick_gelu",  # CLIP's; mlx-vlm's FastGELUMLP
    "layer_norm_eps": 1e-05,
    "torch_dtype": "float32",
}

LLAVA_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "ignore_index": -100,
    "image_token_index": LLAVA_IMAGE_TOKEN_ID,
    "image_seq_length": LLAVA_IMAGE_SEQ_LEN,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": LLAVA_VOCAB_SIZE,
    "bos_token_id": LLAVA_BOS_TOKEN_ID,
    "eos_token_id": LLAVA_EOS_TOKEN_ID,
    "pad_token_id": LLAVA_PAD_TOKEN_ID,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "text_config": LLAVA_TEXT_CONFIG,
    "vision_config": LLAVA_VISION_CONFIG,
}

# llava-hf/llava-1.5-7b-hf's public chat template.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{# Render all text next #}"
    "{% if message['role'] != 'assistant' %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{% generation %}{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

# llava-1.5-7b-hf's CLIPImageProcessor configuration, at 64x64.
LLAVA_PREPROCESSOR_CONFIG = {
    "crop_size": {"height": LLAVA_IMAGE_SIZE, "width": LLAVA_IMAGE_SIZE},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": LLAVA_IMAGE_SIZE},
}

# (64/16)^2 + 1 (CLS) - 1 ("default" drops CLS) = 16 <image> tokens per image.
LLAVA_PROCESSOR_CONFIG = {
    "image_token": LLAVA_IMAGE,
    "num_additional_image_tokens": 1,
    "patch_size": LLAVA_PATCH_SIZE,
    "processor_class": "LlavaProcessor",
    "vision_feature_select_strategy": "default",
}


def build_llava_tokenizer(out: Path) -> None:
    """SmolLM2's tokenizer.json plus llava's <image> and <pad> (special)."""
    added_tokens_decoder = extend_tokenizer(out, LLAVA_ADDED)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_eos_token": False,
            "add_prefix_space": False,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": LLAVA_BOS,
            "chat_template": LLAVA_CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "eos_token": LLAVA_EOS,
            "legacy": False,
            "model_max_length": 4096,
            "pad_token": LLAVA_PAD,
            "padding_side": "left",
            "processor_class": "LlavaProcessor",
            "tokenizer_class": "GPT2Tokenizer",
            "unk_token": LLAVA_UNK,
            "vocab_size": BASE_VOCAB,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "bos_token": LLAVA_BOS,
            "eos_token": LLAVA_EOS,
            "image_token": LLAVA_IMAGE,
            "pad_token": LLAVA_PAD,
            "unk_token": LLAVA_UNK,
        },
    )
    write_json(out / "chat_template.json", {"chat_template": LLAVA_CHAT_TEMPLATE})


def build_llava_weights(out: Path) -> int:
    """Random weights from mlx-vlm's own LLaVA classes; returns param count."""
    from mlx_vlm.models import llava

    mx.random.seed(SEED)
    model_config = llava.ModelConfig.from_dict(LLAVA_CONFIG)
    model_config.text_config = llava.TextConfig.from_dict(LLAVA_TEXT_CONFIG)
    model_config.vision_config = llava.VisionConfig.from_dict(LLAVA_VISION_CONFIG)
    model = llava.Model(model_config)
    # mlx-vlm starts CLIP's class embedding at zeros; give it CLIP's random init.
    embeddings = model.vision_tower.vision_model.embeddings
    dim = LLAVA_VISION_CONFIG["hidden_size"]
    embeddings.class_embedding = mx.random.normal((dim,)) * dim**-0.5
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(v.size for v in weights.values())


def build_llava(out: Path = LLAVA_OUT) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_llava_tokenizer(out)
    n_params = build_llava_weights(out)
    write_json(out / "config.json", LLAVA_CONFIG)
    write_json(out / "preprocessor_config.json", LLAVA_PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", LLAVA_PROCESSOR_CONFIG)
    print(f"wrote {out.relative_to(ROOT)} ({n_params:,} parameters)")
    for p in sorted(out.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size:>10,d} bytes")


def _greedy(step, logits, n: int):
    """n greedy tokens from the first logits; step(token) gives the next."""
    tokens, margins = [], []
    for _ in range(n):
        top2 = mx.sort(logits[0])[-2:]
        margins.append(float(top2[1] - top2[0]))
        token = int(mx.argmax(logits[0]))
        tokens.append(token)
        logits = step(token)
    return tokens, min(margins)


def _drop_tokenizer_kwargs(processor) -> None:
    """Work around mlx-vlm 0.7.10 + transformers 5 for mlx_vlm.generate.

    mlx-vlm's ``process_inputs`` always calls the processor with
    ``padding=True``, and its ``LlavaProcessor.__call__`` hands every kwarg on
    to the image processor, whose ``preprocess`` in transformers 5 validates
    its kwargs strictly (``ImagesKwargs.__init__() got an unexpected keyword
    argument 'padding'``; mlx-vlm issue #870, fixed there for PaliGemma only).
    This makes the image processor ignore kwargs that are not its own; the
    processor called without them (as the runner does) needs no help.
    """
    image_processor = processor.image_processor
    valid = set(image_processor.valid_kwargs.__required_keys__) | set(image_processor.valid_kwargs.__optional_keys__)
    preprocess = image_processor.preprocess

    def preprocess_own_kwargs(images, *args, **kwargs):
        return preprocess(images, *args, **{k: v for k, v in kwargs.items() if k in valid})

    image_processor.preprocess = preprocess_own_kwargs


def verify_llava(out: Path = LLAVA_OUT) -> None:
    import mlx_vlm
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache as make_lm_cache
    from mlx_lm.utils import _get_classes
    from mlx_vlm.models.cache import make_prompt_cache
    from PIL import Image
    from tokenizers import Tokenizer
    from transformers.models.llava import LlavaProcessor as HFLlavaProcessor

    model, processor = mlx_vlm.load(str(out))
    print(
        f"loaded {type(model).__module__}.{type(model).__name__} with "
        f"{type(processor).__module__}.{type(processor).__name__} / "
        f"{type(processor.image_processor).__name__} / "
        f"{type(processor.tokenizer).__name__}"
    )
    tokenizer = processor.tokenizer
    for content, want in {**LLAVA_TOKEN_IDS, LLAVA_EOS: LLAVA_EOS_TOKEN_ID}.items():
        got = tokenizer.convert_tokens_to_ids(content)
        assert got == want, (content, got, want)
    assert tokenizer.eos_token_id == LLAVA_EOS_TOKEN_ID, tokenizer.eos_token_id
    assert tokenizer.pad_token_id == LLAVA_PAD_TOKEN_ID, tokenizer.pad_token_id
    assert model.config.image_token_index == LLAVA_IMAGE_TOKEN_ID
    assert processor.image_token_id == LLAVA_IMAGE_TOKEN_ID, processor.image_token_id
    # transformers' tokenizer encodes as SmolLM2's tokenizer.json does
    sample = "Hello world! <image>\nDescribe  the image, please. ASSISTANT:"
    raw = Tokenizer.from_file(str(out / "tokenizer.json")).encode(sample).ids
    assert tokenizer.encode(sample, add_special_tokens=False) == raw
    assert tokenizer.encode(sample) == raw  # no bos / eos added

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    print(f"prompt: {prompt!r}")
    assert prompt == "USER: <image>\nDescribe the image. ASSISTANT:", prompt

    image = gradient_image(LLAVA_IMAGE_SIZE)
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    n_image = ids.count(LLAVA_IMAGE_TOKEN_ID)
    print(
        f"processor: {len(ids)} prompt tokens, {n_image} <image> tokens "
        f"(expected {LLAVA_IMAGE_SEQ_LEN}); pixel_values {tuple(inputs['pixel_values'].shape)}"
    )
    print(f"input_ids: {ids}")
    assert n_image == LLAVA_IMAGE_SEQ_LEN
    assert tuple(inputs["pixel_values"].shape) == (1, 3, LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE)

    # transformers' own LlavaProcessor reads the same files offline and agrees.
    hf = HFLlavaProcessor.from_pretrained(str(out))
    hf_inputs = hf(text=[prompt], images=[image], return_tensors="np")
    assert hf_inputs["input_ids"][0].tolist() == ids, hf_inputs["input_ids"][0].tolist()
    assert np.allclose(hf_inputs["pixel_values"], np.array(inputs["pixel_values"]), atol=1e-5)
    print(f"transformers {type(hf).__name__} / {type(hf.image_processor).__name__}: same input_ids and pixel_values")

    # The merge takes exactly the processor's <image> positions.
    features = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"])
    plain = model.language_model.model.embed_tokens(inputs["input_ids"])
    changed = np.nonzero(np.any(np.array(features.inputs_embeds != plain), axis=-1)[0])[0].tolist()
    assert changed == [i for i, t in enumerate(ids) if t == LLAVA_IMAGE_TOKEN_ID], changed

    try:
        mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=1, temperature=0.0)
    except ValueError as error:
        print(f"mlx_vlm.generate as installed: {error}; ignoring tokenizer kwargs in the image processor")
        _drop_tokenizer_kwargs(processor)
    result = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)
    print(
        f"generate: prompt_tokens={result.prompt_tokens} "
        f"generation_tokens={result.generation_tokens} "
        f"finish_reason={result.finish_reason}"
    )
    print(f"generated token ids: {result.token_ids}")
    print(f"generated text: {result.text!r}")
    assert result.prompt_tokens == len(ids)
    assert result.generation_tokens > 0

    # The same greedy decode by hand: get_input_embeddings merges the
    # projected CLIP features into the <image> positions, then the language
    # model runs on inputs_embeds.
    n = len(result.token_ids)
    cache = make_prompt_cache(model.language_model)
    embeds = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"]).inputs_embeds
    logits = model.language_model(inputs["input_ids"], inputs_embeds=embeds, cache=cache).logits[:, -1, :]
    manual, margin = _greedy(lambda t: model.language_model(mx.array([[t]]), cache=cache).logits[:, -1, :], logits, n)
    print(f"manual greedy token ids: {manual}")
    print(f"min top1-top2 logit margin: {margin:.4f}")
    assert manual == result.token_ids, (manual, result.token_ids)

    # Another image, another answer.
    other = Image.new("RGB", (LLAVA_IMAGE_SIZE, LLAVA_IMAGE_SIZE), (20, 200, 90))
    other_result = mlx_vlm.generate(model, processor, prompt, image=[other], max_tokens=12, temperature=0.0)
    print(f"another image's token ids: {other_result.token_ids}")
    assert other_result.token_ids != result.token_ids

    # mlx-lm's llama, built from text_config, over the same weight arrays.
    text_config = dict(LLAVA_CONFIG["text_config"])
    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    ours = {name for name, _ in tree_flatten(text.parameters())}
    theirs = [name for name, _ in tree_flatten(model.language_model.parameters())]
    renamed = {name: name if name in ours else f"model.{name}" for name in theirs}
    text.load_weights(
        [(renamed[name], v) for name, v in tree_flatten(model.language_model.parameters())],
        strict=True,
    )
    prefixed = sorted(name for name, new in renamed.items() if new != name)
    print(
        f"mlx-lm {model_class.__module__}.{model_class.__name__}: {len(theirs)} arrays loaded strictly, "
        f"{len(prefixed)} renamed{': ' + ', '.join(prefixed) if prefixed else ' (same names)'}"
    )
    lm_cache = make_lm_cache(text)
    logits = text(inputs["input_ids"], cache=lm_cache, input_embeddings=embeds)[:, -1, :]
    lm_tokens, margin = _greedy(lambda t: text(mx.array([[t]]), cache=lm_cache)[:, -1, :], logits, n)
    print(f"mlx-lm greedy token ids: {lm_tokens} (min margin {margin:.4f})")
    assert lm_tokens == result.token_ids, (lm_tokens, result.token_ids)


def main() -> None:
    t0 = time.perf_counter()
    build()
    verify()
    build_llava()
    verify_llava()
    print(f"done in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    main()
