"""Build a tiny random-weight Mistral 3 vision-language model (mlx-vlm's ``mistral3``) for vision tests.

    python models/train_vision_mistral3.py [OUT_DIR]

Writes ``models/vision/mistral3/`` by default, in Mistral-Small-3.1-24B-Instruct-2503's layout shrunk:

* vision: Pixtral, hidden 32, 2 layers, 2 heads (head_dim 16), intermediate 64, patch 14 (the real one's),
  image_size / longest edge 112, so a 112x112 image is 8x8 patches;
* projector: RMSNorm -> patch merger (``spatial_merge_size`` 2, as the real one: 2x2 patches -> 1 token)
  -> linear / GELU / linear, no bias; a 112x112 image gives 4x4 = 16 ``[IMG]`` tokens, laid out by the
  processor as 4 rows of 4 ``[IMG]`` separated by ``[IMG_BREAK]`` with a final ``[IMG_END]`` (20 tokens);
* text: ``mistral`` (mlx-vlm's Pixtral/Mistral language model; mlx-lm serves it as ``llama``), hidden 16,
  2 layers, 2 heads / 1 kv head, head_dim 8, untied ``lm_head`` as the real one. ``text_config`` carries the
  real one's keys only: like the real ``config.json`` it has no ``tie_word_embeddings`` (transformers'
  ``MistralConfig`` default is False, mlx-vlm's too, but mlx-lm's ``llama`` ``ModelArgs`` defaults to True);
* SmolLM2's tokenizer plus Mistral's special tokens in Mistral's order (``<unk>``, ``<s>``, ``</s>``,
  ``[INST]``, ``[/INST]``, ``[IMG]``, ``[IMG_BREAK]``, ``[IMG_END]``, ``[SYSTEM_PROMPT]``,
  ``[/SYSTEM_PROMPT]``, ``<pad>``: ids 49152-49162), the real preprocessor / processor configuration
  (``PixtralImageProcessor``, ``PixtralProcessor``, CLIP mean/std, bicubic) at 112 px, and a Mistral-style
  chat template (``<s>[INST][IMG]text[/INST]``, images before text).

No vision model can be fetched here: random weights in the real architecture, stored float32 under mlx-vlm's
module names (a random model's top logits tie in bfloat16). It checks itself: mlx-vlm loads it strictly (its
processor is mlx-vlm's own ``Mistral3Processor`` / ``PixtralImageProcessor``, which work offline and without
torch, unlike transformers' ``PixtralProcessor``), ``[IMG]`` expands as transformers' ``replace_image_token``
does, and mlx-lm's ``llama`` built from ``text_config`` over mlx-vlm's language-model arrays, fed
``model.get_input_embeddings(...)``, gives ``mlx_vlm.generate``'s 12 greedy tokens, for this image and for
another (non-square) one that changes them, and for a tied variant built in memory. It also shows the trap:
from ``text_config`` as written mlx-lm builds a tied model, the real ``lm_head`` is dropped and the tokens
differ; ``tie_word_embeddings`` must come from mlx-vlm's parsed config. Runs on the CPU in seconds.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from vision_build import BASE_VOCAB, extend_tokenizer, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "vision" / "mistral3"

SEED = 0
UNK, BOS, EOS = "<unk>", "<s>", "</s>"
INST, END_INST = "[INST]", "[/INST]"
IMG, IMG_BREAK, IMG_END = "[IMG]", "[IMG_BREAK]", "[IMG_END]"
SYSTEM, END_SYSTEM = "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"
PAD = "<pad>"
ADDED = [UNK, BOS, EOS, INST, END_INST, IMG, IMG_BREAK, IMG_END, SYSTEM, END_SYSTEM, PAD]
TOKEN_IDS = {t: BASE_VOCAB + i for i, t in enumerate(ADDED)}
VOCAB_SIZE = BASE_VOCAB + len(ADDED)  # 49163

IMAGE_SIZE = 112  # longest edge
PATCH_SIZE = 14
SPATIAL_MERGE = 2
ROWS = COLS = IMAGE_SIZE // (PATCH_SIZE * SPATIAL_MERGE)  # 4
IMAGE_TOKENS = ROWS * COLS  # 16 [IMG] (+ 3 [IMG_BREAK] + 1 [IMG_END])

# Mistral-Small-3.1-24B-Instruct-2503's text_config keys, shrunk (no tie_word_embeddings, as there).
TEXT_CONFIG = {
    "attention_dropout": 0.0,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 16,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "max_position_embeddings": 4096,
    "model_type": "mistral",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000000.0,
    "sliding_window": None,
    "use_cache": True,
    "vocab_size": VOCAB_SIZE,
}
VISION_CONFIG = {
    "attention_dropout": 0.0,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 32,
    "image_size": IMAGE_SIZE,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "model_type": "pixtral",
    "num_attention_heads": 2,
    "num_channels": 3,
    "num_hidden_layers": 2,
    "patch_size": PATCH_SIZE,
    "rope_theta": 10000.0,
}
CONFIG = {
    "architectures": ["Mistral3ForConditionalGeneration"],
    "model_type": "mistral3",
    "image_token_index": TOKEN_IDS[IMG],
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": SPATIAL_MERGE,
    "vision_feature_layer": -1,
    "bos_token_id": TOKEN_IDS[BOS],
    "eos_token_id": TOKEN_IDS[EOS],
    "pad_token_id": TOKEN_IDS[PAD],
    "torch_dtype": "float32",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
}

# Mistral-Small-3.1's template without its default system message; images first, then text.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '[SYSTEM_PROMPT]' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}"
    "{% if block['type'] in ['image', 'image_url'] %}{{ '[IMG]' }}{% endif %}{% endfor %}"
    "{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '[/INST]' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for block in message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

PREPROCESSOR_CONFIG = {
    "crop_size": None,
    "data_format": "channels_first",
    "default_to_square": True,
    "do_center_crop": None,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "PixtralImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": {"height": PATCH_SIZE, "width": PATCH_SIZE},
    "processor_class": "PixtralProcessor",
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"longest_edge": IMAGE_SIZE},
}
PROCESSOR_CONFIG = {
    "image_break_token": IMG_BREAK,
    "image_end_token": IMG_END,
    "image_token": IMG,
    "patch_size": PATCH_SIZE,
    "processor_class": "PixtralProcessor",
    "spatial_merge_size": SPATIAL_MERGE,
}


def build_tokenizer(out: Path) -> None:
    added_tokens_decoder = extend_tokenizer(out, ADDED)
    write_json(
        out / "tokenizer_config.json",
        {
            "add_bos_token": False,  # the chat template writes <s>
            "add_eos_token": False,
            "added_tokens_decoder": added_tokens_decoder,
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "unk_token": UNK,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "legacy": False,
            "model_max_length": 4096,
            "processor_class": "PixtralProcessor",
            "tokenizer_class": "GPT2Tokenizer",
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK},
    )
    write_json(out / "chat_template.json", {"chat_template": CHAT_TEMPLATE})


def make_model(config: dict):
    """mlx-vlm's mistral3 Model with deterministic random float32 weights."""
    from mlx_vlm.models import mistral3

    mx.random.seed(SEED)
    cfg = mistral3.ModelConfig.from_dict(config)
    cfg.text_config = mistral3.TextConfig.from_dict(config["text_config"])
    cfg.vision_config = mistral3.VisionConfig.from_dict(config["vision_config"])
    model = mistral3.Model(cfg)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def build_weights(out: Path) -> int:
    model = make_model(CONFIG)
    weights = dict(tree_flatten(model.parameters()))
    assert "language_model.lm_head.weight" in weights  # untied, as Mistral-Small-3.1
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
    for p in sorted(out.iterdir()):
        print(f"  {p.name:28s} {p.stat().st_size:>10,d} bytes")


def gradient_image(width: int = IMAGE_SIZE, height: int = IMAGE_SIZE):
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), ((x // 8 + y // 8) % 2) * 255], axis=-1).astype(
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


def _generate(model, processor, prompt, image):
    import mlx_vlm

    try:
        return mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)
    except ValueError as e:
        print(f"mlx_vlm.generate failed: {e!r}; ignoring tokenizer kwargs in the image processor")
        sys.path.insert(0, str(ROOT / "models"))
        from train_vision import _drop_tokenizer_kwargs

        _drop_tokenizer_kwargs(processor)
        return mlx_vlm.generate(model, processor, prompt, image=[image], max_tokens=12, temperature=0.0)


def mlx_lm_text_model(model, text_config: dict):
    """mlx-lm's class for text_config over mlx-vlm's language-model arrays (the runner's recipe)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    ours = {name for name, _ in tree_flatten(text.parameters())}
    theirs = tree_flatten(model.language_model.parameters())
    dropped = [name for name, _ in theirs if name == "lm_head.weight" and name not in ours]
    renamed = [(name if name in ours else f"model.{name}", v) for name, v in theirs if name not in dropped]
    text.load_weights(renamed, strict=True)
    return text, f"{model_class.__module__}.{model_class.__name__}", dropped


def compare(model, processor, prompt, image, text_config: dict, label: str):
    """mlx_vlm.generate's greedy tokens vs mlx-lm's text model fed get_input_embeddings."""
    from mlx_lm.models.cache import make_prompt_cache

    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    n_img = ids.count(TOKEN_IDS[IMG])
    result = _generate(model, processor, prompt, image)
    vlm_tokens = list(result.token_ids)
    assert result.prompt_tokens == len(ids), (result.prompt_tokens, len(ids))
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    out = model.get_input_embeddings(
        inputs["input_ids"], inputs["pixel_values"], mask=inputs["attention_mask"], **extra
    )
    embeds = getattr(out, "inputs_embeds", out)
    text, cls, dropped = mlx_lm_text_model(model, text_config)
    cache = make_prompt_cache(text)
    logits = text(inputs["input_ids"], cache=cache, input_embeddings=embeds)[:, -1, :]
    lm_tokens, margin = _greedy(lambda t: text(mx.array([[t]]), cache=cache)[:, -1, :], logits, len(vlm_tokens))
    match = lm_tokens == vlm_tokens
    print(
        f"[{label}] {len(ids)} prompt tokens, {n_img} [IMG], {ids.count(TOKEN_IDS[IMG_BREAK])} [IMG_BREAK], "
        f"{ids.count(TOKEN_IDS[IMG_END])} [IMG_END]; pixel_values {tuple(inputs['pixel_values'].shape)}, "
        f"image_sizes {[list(map(int, s)) for s in extra.get('image_sizes', [])]}, extra inputs {sorted(extra)}"
    )
    print(f"[{label}] mlx_vlm.generate: {vlm_tokens} {result.text!r}")
    print(
        f"[{label}] mlx-lm {cls} (lm_head dropped: {bool(dropped)}): {lm_tokens} "
        f"match={match} min top1-top2 margin {margin:.4f}"
    )
    return vlm_tokens, lm_tokens, margin, n_img, ids


def verify(out: Path) -> None:
    import mlx_vlm
    import numpy as np
    from mlx_vlm.prompt_utils import apply_chat_template
    from tokenizers import Tokenizer

    model, processor = mlx_vlm.load(str(out))
    print(
        f"loaded {type(model).__module__}.{type(model).__name__} / {type(processor).__module__}."
        f"{type(processor).__name__} / {type(processor.image_processor).__name__} / "
        f"{type(processor.tokenizer).__name__}"
    )
    print(
        f"mlx-vlm text config: tie_word_embeddings={model.config.text_config.tie_word_embeddings}; "
        f"language model {type(model.language_model.model).__module__}.{type(model.language_model.model).__name__}"
    )
    tokenizer = processor.tokenizer
    for t, want in TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(t) == want, (t, tokenizer.convert_tokens_to_ids(t), want)
    sample = "Hello world! [IMG]Describe  the image, please.[/INST]"
    raw = Tokenizer.from_file(str(out / "tokenizer.json")).encode(sample).ids
    assert tokenizer.encode(sample, add_special_tokens=False) == raw
    assert tokenizer.encode(sample) == raw  # no <s> added: the template writes it
    assert (processor.patch_size, processor.spatial_merge_size) == (PATCH_SIZE, SPATIAL_MERGE)

    prompt = apply_chat_template(processor, model.config, "Describe the image.", num_images=1)
    print(f"prompt: {prompt!r}")
    assert prompt == "<s>[INST][IMG]Describe the image.[/INST]", prompt

    image = gradient_image()
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    print(f"input_ids: {ids}")
    # transformers' PixtralProcessor.replace_image_token (which needs torch to import): rows of
    # width // (patch * merge) [IMG], each followed by [IMG_BREAK], the last [IMG_BREAK] made [IMG_END].
    i, b, e = TOKEN_IDS[IMG], TOKEN_IDS[IMG_BREAK], TOKEN_IDS[IMG_END]
    expanded = ([i] * COLS + [b]) * ROWS
    expanded[-1] = e
    start = ids.index(i)
    assert ids[start : start + len(expanded)] == expanded, ids
    assert ids.count(i) == IMAGE_TOKENS

    # The merge fills exactly the [IMG] positions; text rows are raw embed_tokens (no scaling in Mistral).
    emb = model.get_input_embeddings(
        inputs["input_ids"], inputs["pixel_values"], mask=inputs["attention_mask"], image_sizes=inputs["image_sizes"]
    ).inputs_embeds
    plain = model.language_model.model.embed_tokens(inputs["input_ids"])
    changed = np.nonzero(np.any(np.array(emb != plain), axis=-1)[0])[0].tolist()
    assert changed == [k for k, t in enumerate(ids) if t == i], changed
    print(f"get_input_embeddings: {len(changed)} rows replaced, exactly the [IMG] positions; dtype {emb.dtype}")

    real_text_config = dict(CONFIG["text_config"])  # as in config.json: no tie_word_embeddings
    fixed_text_config = {**real_text_config, "tie_word_embeddings": model.config.text_config.tie_word_embeddings}

    print("-- mlx-lm from text_config as written (mlx-lm llama defaults tie_word_embeddings=True):")
    v0, l0, _, _, _ = compare(model, processor, prompt, image, real_text_config, "as-is")
    print("-- mlx-lm from text_config + tie_word_embeddings from mlx-vlm's config (False):")
    v1, l1, m1, n1, _ = compare(model, processor, prompt, image, fixed_text_config, "fixed")
    assert l1 == v1, (l1, v1)

    other = gradient_image(IMAGE_SIZE, IMAGE_SIZE // 2).transpose(0)  # 112 wide, 56 tall, mirrored
    v2, l2, m2, n2, _ = compare(model, processor, prompt, other, fixed_text_config, "other image 112x56")
    assert l2 == v2, (l2, v2)
    print(f"another image changes the tokens: {v2 != v1}")
    assert v2 != v1

    # A tied variant (Ministral-style tie_word_embeddings true), built in memory with the same processor.
    tied_config = {**CONFIG, "text_config": {**TEXT_CONFIG, "tie_word_embeddings": True}}
    tied = make_model(tied_config)
    assert not hasattr(tied.language_model, "lm_head")
    v3, l3, m3, _, _ = compare(tied, processor, prompt, image, tied_config["text_config"], "tied variant")
    assert l3 == v3, (l3, v3)

    print(
        f"SUMMARY: match={l1 == v1 and l2 == v2 and l3 == v3} (untied, other image, tied), "
        f"as-written text_config match={l0 == v0}; image tokens {n1} [IMG] for {IMAGE_SIZE}x{IMAGE_SIZE} "
        f"({n2} for 112x56); min margin {min(m1, m2, m3):.4f}"
    )


if __name__ == "__main__":
    t0 = time.perf_counter()
    build(OUT)
    verify(OUT)
    print(f"done in {time.perf_counter() - t0:.1f}s")
