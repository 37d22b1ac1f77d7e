"""Build a tiny random-weight Gemma 3 vision-language model (mlx-vlm's ``gemma3``) for issue #39's tests.

    python models/train_vision_gemma3.py [OUT_DIR] [SLIDING_WINDOW]

Writes ``models/vision/gemma3/`` by default: a SigLIP tower, Gemma 3's projector (average-pooled to 16 image
tokens) and a gemma3 text model (hidden 32, 2 layers, one sliding and one global; a sliding window of 512 by
default, 8 on the command line to make a prompt pass it: its top logits are then closer, 0.0004 apart),
SmolLM2's tokenizer with Gemma 3's added tokens (``<start_of_turn>``, ``<end_of_turn>``,
``<start_of_image>``, ``<end_of_image>``, ``<image_soft_token>``, ...), a Gemma 3 processor configuration and a
Gemma 3-style chat template. No vision model can be fetched here: random weights in the real architecture, float32
(a random model's top logits tie in bfloat16). It checks itself: mlx-vlm loads it strictly, and mlx-lm's
``gemma3_text`` fed mlx-vlm's ``get_input_embeddings`` gives ``mlx_vlm.generate``'s greedy tokens (the runner
serves it that way: runner/vision.py).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from vision_build import BASE_VOCAB, extend_tokenizer, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "vision" / "gemma3"
SLIDING_WINDOW = int(sys.argv[2]) if len(sys.argv) > 2 else 512

SEED = 0
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
BOI = "<start_of_image>"
EOI = "<end_of_image>"
IMAGE = "<image_soft_token>"
PAD = "<pad>"
BOS = "<bos>"
EOS = "<eos>"
ADDED = [START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE, PAD, BOS, EOS]
TOKEN_IDS = {t: BASE_VOCAB + i for i, t in enumerate(ADDED)}
VOCAB_SIZE = BASE_VOCAB + len(ADDED)  # 49160

IMAGE_SIZE = 64
PATCH_SIZE = 8  # 8x8 = 64 patches, avg-pooled 2x2 -> 4x4 = 16 tokens
MM_TOKENS = 16

TEXT_CONFIG = {
    "model_type": "gemma3_text",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "rope_scaling": None,
    "sliding_window": SLIDING_WINDOW,
    "sliding_window_pattern": 2,  # layer 0 sliding, layer 1 global
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 4096,
    "mm_tokens_per_image": MM_TOKENS,
    "vocab_size": VOCAB_SIZE,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh",
    "torch_dtype": "float32",
}
VISION_CONFIG = {
    "model_type": "siglip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "layer_norm_eps": 1e-6,
    "vision_use_head": False,
}
CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": TOKEN_IDS[BOI],
    "eoi_token_index": TOKEN_IDS[EOI],
    "image_token_index": TOKEN_IDS[IMAGE],
    "mm_tokens_per_image": MM_TOKENS,
    "pad_token_id": TOKEN_IDS[PAD],
    "bos_token_id": TOKEN_IDS[BOS],
    "eos_token_id": [TOKEN_IDS[EOS], TOKEN_IDS[END_OF_TURN]],
    "initializer_range": 0.02,
    "torch_dtype": "float32",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

PREPROCESSOR_CONFIG = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": MM_TOKENS,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 1 / 255,
    "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
}
PROCESSOR_CONFIG = {"image_seq_length": MM_TOKENS, "processor_class": "Gemma3Processor"}


def build_tokenizer(out: Path) -> None:
    added_tokens_decoder = extend_tokenizer(out, ADDED)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,
            "add_eos_token": False,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": "<|endoftext|>",
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": IMAGE},
            "model_max_length": 4096,
            "processor_class": "Gemma3Processor",
            "tokenizer_class": "GPT2Tokenizer",
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "boi_token": BOI,
            "eoi_token": EOI,
            "image_token": IMAGE,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": "<|endoftext|>",
        },
    )
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def build_weights(out: Path) -> int:
    from mlx_vlm.models import gemma3

    mx.random.seed(SEED)
    cfg = gemma3.ModelConfig.from_dict(CONFIG)
    cfg.text_config = gemma3.TextConfig.from_dict(TEXT_CONFIG)
    cfg.vision_config = gemma3.VisionConfig.from_dict(VISION_CONFIG)
    model = gemma3.Model(cfg)
    # mlx-vlm inits the projection to ones and RMSNorm scales to ones (i.e. 2x);
    # randomise so the image actually matters.
    proj = model.multi_modal_projector
    proj.mm_input_projection_weight = mx.random.normal(proj.mm_input_projection_weight.shape) * 0.2
    model.set_dtype(mx.float32)
    weights = dict(tree_flatten(model.parameters()))
    # Gemma 3 ties lm_head to embed_tokens (no lm_head in the checkpoint);
    # mlx-vlm's sanitize copies embed_tokens into lm_head on load.
    weights.pop("language_model.lm_head.weight")
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return sum(v.size for v in weights.values())


def build(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    build_tokenizer(out)
    n = build_weights(out)
    write_json(out / "config.json", CONFIG)
    write_json(out / "preprocessor_config.json", PREPROCESSOR_CONFIG)
    write_json(out / "processor_config.json", PROCESSOR_CONFIG)
    print(f"wrote {out} ({n:,} parameters)")


def gradient_image(size: int = 64):
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:size, 0:size]
    rgb = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), ((x // 8 + y // 8) % 2) * 255], axis=-1).astype(
        np.uint8
    )
    return Image.fromarray(rgb, "RGB")


def _greedy(step, logits, n):
    tokens, margins = [], []
    for _ in range(n):
        top2 = mx.sort(logits[0])[-2:]
        margins.append(float(top2[1] - top2[0]))
        t = int(mx.argmax(logits[0]))
        tokens.append(t)
        logits = step(t)
    return tokens, min(margins)


def verify(out: Path) -> None:
    import mlx_vlm
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache as make_lm_cache
    from mlx_lm.utils import _get_classes
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = mlx_vlm.load(str(out))
    print(
        f"loaded {type(model).__module__}.{type(model).__name__} / {type(processor).__module__}."
        f"{type(processor).__name__} / {type(processor.image_processor).__name__} / "
        f"{type(processor.tokenizer).__name__}"
    )
    print(f"config.hidden_size (top level, used for image scaling) = {model.config.hidden_size}")
    print(f"processor.image_seq_length = {processor.image_seq_length}")
    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    print(f"prompt: {prompt!r}")
    image = gradient_image(IMAGE_SIZE)
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    print(
        f"{len(ids)} prompt tokens, {ids.count(TOKEN_IDS[IMAGE])} image soft tokens; "
        f"pixel_values {tuple(inputs['pixel_values'].shape)}"
    )
    print(f"input_ids: {ids}")

    try:
        result = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)
    except Exception as e:  # noqa: BLE001
        print(f"generate failed: {e!r}; dropping tokenizer kwargs")
        sys.path.insert(0, str(ROOT / "models"))
        from train_vision import _drop_tokenizer_kwargs

        _drop_tokenizer_kwargs(processor)
        result = mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)
    vlm_tokens = list(result.token_ids)
    print(f"mlx_vlm.generate: prompt_tokens={result.prompt_tokens} tokens={vlm_tokens} text={result.text!r}")
    assert result.prompt_tokens == len(ids)
    n = len(vlm_tokens)

    def embeds():
        # fresh every time: both language models do `h *= scale` in place
        return model.get_input_embeddings(
            inputs["input_ids"], inputs["pixel_values"], mask=inputs["attention_mask"]
        ).inputs_embeds

    e = embeds()
    plain = model.language_model.model.embed_tokens(inputs["input_ids"])
    text_pos = [i for i, t in enumerate(ids) if t != TOKEN_IDS[IMAGE]]
    print(
        "get_input_embeddings: text rows == raw embed_tokens (unscaled):",
        bool(mx.array_equal(e[0, text_pos], plain[0, text_pos])),
        f"dtype {e.dtype}",
    )
    e_before = np.array(e)

    # manual mlx-vlm greedy
    cache = make_prompt_cache(model.language_model)
    logits = model.language_model(inputs["input_ids"], inputs_embeds=e, cache=cache).logits[:, -1, :]
    print(
        "mlx-vlm LanguageModel mutates the caller's inputs_embeds in place:", not np.array_equal(np.array(e), e_before)
    )
    manual, m = _greedy(lambda t: model.language_model(mx.array([[t]]), cache=cache).logits[:, -1, :], logits, n)
    print(f"manual mlx-vlm greedy: {manual} (min margin {m:.4f})")

    # mlx-lm gemma3_text over the same arrays
    text_config = dict(CONFIG["text_config"])
    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    vlm_weights = tree_flatten(model.language_model.parameters())
    text.load_weights(vlm_weights, strict=True)
    print(
        f"mlx-lm {model_class.__module__}.{model_class.__name__}: {len(vlm_weights)} arrays loaded strictly "
        "(same names)"
    )
    for i, layer in enumerate(text.layers):
        print(
            f"  layer {i}: mlx-lm is_sliding={layer.self_attn.is_sliding} "
            f"vlm is_sliding={model.language_model.layers[i].self_attn.is_sliding}"
        )
    # also check the tied path: mlx-lm sanitize without lm_head
    text2 = model_class(args_class.from_dict(text_config))
    w2 = text2.sanitize({k: v for k, v in vlm_weights if k != "lm_head.weight"})
    text2.load_weights(list(w2.items()), strict=True)

    def run_lm(lm, emb, label):
        c = make_lm_cache(lm)
        e_in = emb
        before = np.array(e_in)
        lg = lm(inputs["input_ids"], cache=c, input_embeddings=e_in)[:, -1, :]
        mutated = not np.array_equal(np.array(e_in), before)
        toks, mm = _greedy(lambda t: lm(mx.array([[t]]), cache=c)[:, -1, :], lg, n)
        print(f"{label}: {toks} (min margin {mm:.4f}; caller's embeds mutated: {mutated}) match={toks == vlm_tokens}")
        return toks

    # prefill logits diff
    ref = model.language_model(inputs["input_ids"], inputs_embeds=embeds()).logits
    got = text(inputs["input_ids"], input_embeddings=embeds())
    print(f"prefill logits max|diff| vlm vs mlx-lm (no cache): {float(mx.abs(ref - got).max()):.3e}")

    run_lm(text, embeds(), "mlx-lm gemma3_text, embeds as-is")
    run_lm(text2, embeds(), "mlx-lm gemma3_text tied (sanitize), embeds as-is")
    scale = mx.array(TEXT_CONFIG["hidden_size"] ** 0.5, mx.bfloat16).astype(mx.float32)
    run_lm(text, embeds() / scale, "mlx-lm, embeds / sqrt(hidden)  [wrong correction]")
    run_lm(text, embeds() * scale, "mlx-lm, embeds * sqrt(hidden)  [double scale]")

    from PIL import Image

    other = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (20, 200, 90))
    o = mlx_vlm.generate(model, processor, prompt, image=[other], max_tokens=12, temperature=0.0)
    print(f"another image: {list(o.token_ids)} differs={list(o.token_ids) != vlm_tokens}")

    # text-only sanity: the same ids without pixel values
    t_ids = processor.tokenizer(prompt.replace(BOI, ""), return_tensors=None)["input_ids"]
    t_ids = mx.array([t_ids])
    r1 = model.language_model(t_ids).logits
    r2 = text(t_ids)
    print(f"text-only logits max|diff|: {float(mx.abs(r1 - r2).max()):.3e}")


if __name__ == "__main__":
    build(OUT)
    verify(OUT)
