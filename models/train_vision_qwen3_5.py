"""Build a tiny random-weight Qwen3.5 (mlx-vlm's ``qwen3_5``: natively multimodal, hybrid) for vision tests.

    python models/train_vision_qwen3_5.py [OUT_DIR]

Writes ``models/vision/qwen3_5/`` by default, in Qwen3.5-2B's layout shrunk:

* text (``text_config``, ``model_type`` ``qwen3_5_text``): hidden 64, 4 layers alternating Gated DeltaNet (linear
  attention: 2 key / 2 value heads of 16, conv kernel 4) and gated full attention (2 heads / 1 kv head, head_dim
  64, ``attn_output_gate``), ``full_attention_interval`` 2 (the real one's 4, so that two layers attend), untied
  head (tied, a random model this small repeats its last token), and interleaved M-RoPE on a quarter of each head
  (``partial_rotary_factor`` 0.25, ``mrope_section`` [3, 3, 2]: the real [11, 11, 10] for 64 rotary dims, shrunk);
  q and k projections scaled up 6x from the default init, so that positions change the answer;
* vision: Qwen3-VL's ViT as Qwen3.5 uses it (no deepstack), 2 blocks, hidden 32, 2 heads, patch 16, temporal
  patch 2, ``spatial_merge_size`` 2, learned position embeddings for an 8x8 grid: a 128x128 image is 8x8 patches
  and 16 ``<|image_pad|>`` tokens;
* SmolLM2's tokenizer plus Qwen3.5's vision, tool and thinking tokens (``<think>``, ``</think>`` and the tool
  tags are plain added tokens, as there), Qwen3.5's real chat template (``models/templates/qwen3_5.jinja``: it
  opens ``<think>`` after the generation prompt unless ``enable_thinking`` is false), and a Qwen2-VL style
  image processor at 128x128 px (mean and std 0.5, as Qwen3.5's).

No vision model can be fetched here: random weights in the real architecture, float32. It checks itself: mlx-vlm
loads it strictly with its own processor, an image expands to 16 ``<|image_pad|>``, the text after it takes
positions 12 below its index, and ``mlx_vlm.generate``'s greedy tokens change with another image and with plain
positions (mlx-lm's ``qwen3_5`` over the same arrays at their indices). Runs on the CPU in seconds.
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
from vision_build import BASE_VOCAB, extend_tokenizer, greedy, qwen_layout, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = ROOT / "models" / "templates" / "qwen3_5.jinja"
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "vision" / "qwen3_5"

SEED = 0
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"  # SmolLM2's ids 0, 1, 2
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
PLAIN = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
TOKEN_IDS = {t: BASE_VOCAB + i for i, t in enumerate(SPECIAL + PLAIN)}
VOCAB_SIZE = BASE_VOCAB + len(TOKEN_IDS)  # 49163
IMAGE_TOKENS = 16  # a 128x128 image: 8x8 patches of 16, merged 2x2

TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "attention_bias": False,
    "attn_output_gate": True,
    "eos_token_id": 2,
    "full_attention_interval": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "layer_types": ["linear_attention", "full_attention"] * 2,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 32768,
    "num_attention_heads": 2,
    "num_hidden_layers": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False,
    "vocab_size": VOCAB_SIZE,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "type": "default",
    },
}
VISION_CONFIG = {
    "model_type": "qwen3_5",
    "depth": 2,
    "hidden_size": 32,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "out_hidden_size": 64,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [],
}
CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": TOKEN_IDS["<|image_pad|>"],
    "video_token_id": TOKEN_IDS["<|video_pad|>"],
    "vision_start_token_id": TOKEN_IDS["<|vision_start|>"],
    "vision_end_token_id": TOKEN_IDS["<|vision_end|>"],
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
}
PREPROCESSOR_CONFIG = {
    "size": {"longest_edge": 128 * 128, "shortest_edge": 32 * 32},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def build_tokenizer(out: Path) -> None:
    decoder = extend_tokenizer(out, SPECIAL + PLAIN, special=lambda token: token in SPECIAL)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_prefix_space": False,
            "added_tokens_decoder": decoder,
            "bos_token": None,
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
            "unk_token": None,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "model_max_length": 32768,
            "processor_class": "Qwen3VLProcessor",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
        },
    )
    (out / "chat_template.jinja").write_text(TEMPLATE.read_text())
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [2, 0], "do_sample": False})


def make_model():
    from mlx_vlm.models import qwen3_5

    mx.random.seed(SEED)
    model = qwen3_5.Model(qwen3_5.ModelConfig.from_dict(json.loads(json.dumps(CONFIG))))
    model.set_dtype(mx.float32)
    for layer in model.language_model.model.layers:  # sharper attention: positions must change the answer
        attention = getattr(layer, "self_attn", None)
        if attention is not None:
            attention.q_proj.weight = attention.q_proj.weight * ATTENTION_SCALE
            attention.k_proj.weight = attention.k_proj.weight * ATTENTION_SCALE
    mx.eval(model.parameters())
    return model


def build(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    model = make_model()
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(out / "config.json", CONFIG)
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    print(f"wrote {out} ({sum(v.size for v in weights.values()):,} parameters)")


def plain_positions(model, inputs, n: int) -> list[int]:
    """Greedy tokens of mlx-lm's qwen3_5 over mlx-vlm's language-model arrays fed the prompt's embeddings at
    positions 0..L-1: what a server that ignored M-RoPE would answer."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.cache import make_prompt_cache

    text = qwen3_5.Model(qwen3_5.ModelArgs.from_dict({"model_type": "qwen3_5", "text_config": dict(TEXT_CONFIG)}))
    text.load_weights([(f"language_model.{k}", v) for k, v in tree_flatten(model.language_model.parameters())])
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    embeds = model.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **extra).inputs_embeds
    cache = make_prompt_cache(text)
    logits = text(inputs["input_ids"], cache=cache, input_embeddings=embeds)[:, -1, :]
    return greedy(logits, lambda token: text(mx.array([[token]]), cache=cache)[:, -1, :], n)


def verify(out: Path) -> None:
    import mlx_vlm

    image = gradient_image(128, 128)
    model, processor, prompt, inputs = qwen_layout(
        out, "<|im_start|>assistant\n<think>\n", TOKEN_IDS["<|image_pad|>"], IMAGE_TOKENS, image
    )
    _, deltas = model.language_model.get_rope_index(inputs["input_ids"], inputs["image_grid_thw"])
    delta = int(deltas.reshape(-1)[0])
    assert delta == -(IMAGE_TOKENS - 4), delta
    tokens = []
    for picture in (image, gradient_image(128, 64).transpose(0)):
        result = mlx_vlm.generate(model, processor, prompt, image=[picture], max_tokens=12, temperature=0.0)
        tokens.append(list(result.token_ids))
        print(f"{tuple(picture.size)}: {result.prompt_tokens} prompt tokens; {tokens[-1]} {result.text!r}")
    assert tokens[0] != tokens[1], tokens
    plain = plain_positions(model, inputs, len(tokens[0]))
    print(f"plain positions instead: {plain}")
    assert plain != tokens[0], plain
    print(f"rope delta after one image: {delta}; another image and plain positions change the answer")


if __name__ == "__main__":
    started = time.perf_counter()
    build(OUT)
    verify(OUT)
    print(f"done in {time.perf_counter() - started:.1f}s")
