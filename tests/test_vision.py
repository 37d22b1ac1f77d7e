"""A model that sees (issue #39): images in each API, served through the runner as mlx-vlm serves them.

The models are ``models/vision/smolvlm`` and ``models/vision/llava`` (``make vision-model``,
``models/train_vision.py``): SmolVLM's and LLaVA-1.5's real architectures, processors and chat templates with
random weights (no vision model can be fetched here). Its greedy
tokens through the supervisor are mlx-vlm's own ``generate``'s on the same image and prompt, from every API, alone
and batched; a second turn about one image takes its prefill from the prompt cache; hostile images are refused
with a 400 naming the part, and the runner goes on.
"""

from __future__ import annotations

import base64
import io
import os
import signal
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.processes import SupervisorProcess, model_toml, resumed_on_a_new_runner

VISION_MODEL = Path(__file__).resolve().parents[1] / "models" / "vision" / "smolvlm"
LLAVA_MODEL = VISION_MODEL.parent / "llava"
GEMMA3_MODEL = VISION_MODEL.parent / "gemma3"
MISTRAL3_MODEL = VISION_MODEL.parent / "mistral3"
QWEN2VL_MODEL = VISION_MODEL.parent / "qwen2_vl"
QWEN25VL_MODEL = VISION_MODEL.parent / "qwen2_5_vl"
QWEN35_MODEL = VISION_MODEL.parent / "qwen3_5"
QWEN3VL_MODEL = VISION_MODEL.parent / "qwen3_vl"
QWEN3VLMOE_MODEL = VISION_MODEL.parent / "qwen3_vl_moe"
ASK = "Describe the image."
TOKENS = 12


def png(seed: int = 0, size=(64, 48)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def sup(tmp_path_factory):
    assert (VISION_MODEL / "config.json").is_file(), f"{VISION_MODEL} is missing: run `make vision-model`"
    models = (
        model_toml("seer", target=VISION_MODEL, draft=None)
        + model_toml("looker", target=LLAVA_MODEL, draft=None)
        + model_toml("gazer", target=GEMMA3_MODEL, draft=None)
        + model_toml("viewer", target=MISTRAL3_MODEL, draft=None)
        + model_toml("qwen", target=QWEN2VL_MODEL, draft=QWEN2VL_MODEL)
        + model_toml("qwen25", target=QWEN25VL_MODEL, draft=None)
        + model_toml("qwen35", target=QWEN35_MODEL, draft=QWEN35_MODEL)
        + model_toml("qwen3vl", target=QWEN3VL_MODEL, draft=None, prefill_chunk=16)  # an image across chunks
        + model_toml("qwen3vlmoe", target=QWEN3VLMOE_MODEL, draft=None)
        + model_toml("drafted", target=VISION_MODEL, draft=VISION_MODEL)
        + model_toml("fetcher", target=VISION_MODEL, draft=None, image_urls="public")
        + model_toml("intranet", target=VISION_MODEL, draft=None, image_urls="public", image_url_hosts="127.0.0.1")
        + model_toml("reader")
    )
    process = SupervisorProcess(tmp_path_factory.mktemp("vision"), models).wait_ready(180)
    yield process
    assert process.stop() == 0


def own_kwargs_only(processor) -> None:
    """mlx-vlm 0.7.10's generate passes ``padding=True`` to the processor, which its LlavaProcessor hands on to
    transformers 5's image processor, which refuses it (mlx-vlm issue #870): the image processor is made to take
    only its own arguments. (The runner calls the processor without them.)"""
    image_processor = processor.image_processor
    kinds = image_processor.valid_kwargs
    valid = set(kinds.__required_keys__) | set(kinds.__optional_keys__)
    preprocess = image_processor.preprocess
    image_processor.preprocess = lambda images, *args, **kwargs: preprocess(
        images, *args, **{k: v for k, v in kwargs.items() if k in valid}
    )


def mlx_vlm_reference(folder: Path, images: int = 1):
    """mlx-vlm's own greedy tokens for an image on the model in ``folder`` (``generate`` on its processor and
    template)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm import generate, load
    from PIL import Image

    model, processor = load(str(folder))
    if "llava" in folder.name:
        own_kwargs_only(processor)
    tokenizer = load_tokenizer(folder)
    # As the runner lays a message out: its images, then its text.
    messages = [{"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": ASK}]}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def tokens(*data: bytes) -> list[int]:
        pictures = [Image.open(io.BytesIO(d)).convert("RGB") for d in data]
        result = generate(model, processor, prompt, image=pictures, max_tokens=TOKENS, temperature=0.0)
        return [int(t) for t in result.token_ids]

    return tokens


@pytest.fixture(scope="module")
def reference():
    return mlx_vlm_reference(VISION_MODEL)


def grpc_answer(sup, data: bytes | list, model: str = "seer", **fields):
    chunks = list(
        sup.client.generate(
            timeout=60,
            model=model,
            messages=[{"role": "user", "content": ASK, "images": data if isinstance(data, list) else [data]}],
            max_tokens=TOKENS,
            **fields,
        )
    )
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def test_every_api_answers_an_image_as_mlx_vlm_does(sup, reference):
    image = png(1)
    ids, text, _ = grpc_answer(sup, image)
    assert ids == reference(image)
    assert ids != reference(png(2)), "the image makes no difference to the model"
    openai = sup.openai()
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": ASK}]
    answer = openai.chat.completions.create(
        model="seer", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
    )
    assert answer.choices[0].message.content == text
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    message = sup.anthropic().messages.create(
        model="seer",
        max_tokens=TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": ASK}]}],
    )
    assert message.content[0].text == text
    ollama = sup.ollama().chat(
        model="seer",
        messages=[{"role": "user", "content": ASK, "images": [image]}],
        options={"temperature": 0, "num_predict": TOKENS},
    )
    assert ollama.message.content == text
    assert "vision" in sup.ollama().show("seer").capabilities
    assert "vision" not in sup.ollama().show("reader").capabilities
    response = openai.responses.create(
        model="seer",
        temperature=0,
        max_output_tokens=TOKENS,
        input=[
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": data_url(image)}, {"type": "input_text", "text": ASK}],
            }
        ],
    )
    assert response.output_text == text


def test_speculation_keeps_the_answer_with_every_drafter(sup, reference):
    """An image request speculates: the n-gram lookup over its text, or a draft model of the same vocabulary that
    reads the image tokens as text (it does not see); the target verifies, so the answer is mlx-vlm's."""
    image = png(60)
    expected = reference(image)
    for model, drafter in (("seer", "ngram"), ("drafted", "model"), ("seer", "none")):
        ids, _, last = grpc_answer(sup, image, model, drafter=drafter)
        assert ids == expected and last.stats.drafter == drafter, (model, drafter)
        if drafter == "model":  # it drafts (blind to the image, so the target keeps few of them)
            assert last.stats.drafted > 0


def test_images_batched_answer_as_alone(sup, reference):
    """Four image requests at once (new images: each prefilled with its image, then decoded in one batch) answer
    as mlx-vlm does for each alone."""
    images = [png(10 + i, size=(40 + 8 * i, 40)) for i in range(4)]
    with ThreadPoolExecutor(len(images)) as pool:
        batched = list(pool.map(lambda image: grpc_answer(sup, image)[0], images))
    assert batched == [reference(image) for image in images]


def test_a_second_turn_about_an_image_takes_its_prefill_from_the_cache(sup):
    image = png(20)
    first, _, last = grpc_answer(sup, image)
    again, _, cached = grpc_answer(sup, image)
    assert again == first and cached.stats.cached_tokens == last.stats.prompt_tokens - 1
    other, _, missed = grpc_answer(sup, png(21))  # the same text, another image: not the same prefix
    assert missed.stats.cached_tokens < last.stats.prompt_tokens - 16 and other != first


def test_a_text_request_to_a_model_that_sees_is_a_text_request(sup):
    chunks = list(
        sup.client.generate(timeout=60, model="seer", messages=[{"role": "user", "content": ASK}], max_tokens=8)
    )
    assert sum(len(c.token_ids) for c in chunks) == 8 or chunks[-1].finish_reason


def bomb() -> bytes:
    """A PNG of a few hundred bytes whose header claims 100000 x 100000 pixels."""
    data = bytearray(png(0, size=(8, 8)))
    width_height = struct.pack(">II", 100_000, 100_000)
    data[16:24] = width_height
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def animated_gif() -> bytes:
    from PIL import Image

    frames = [Image.new("RGB", (16, 16), color) for color in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    return out.getvalue()


def truncated_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()[: len(out.getvalue()) // 2]


SVG = b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>'


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(bomb()), "pixels allowed"),
        (data_url(truncated_jpeg(), "jpeg"), "cannot be decoded"),
        (data_url(SVG, "svg+xml"), "not an image"),
        (data_url(animated_gif(), "gif"), "animated"),
        ("http://127.0.0.1:9/cat.png", "not fetched for this model"),
        ("data:image/png;base64,%%%", "base64"),
    ],
)
def test_hostile_images_are_refused_and_the_runner_goes_on(sup, url, words):
    import anthropic
    import openai

    pid = sup.client.model("seer").pid
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": ASK}]
    with pytest.raises(openai.BadRequestError, match=words):
        sup.openai().chat.completions.create(
            model="seer", messages=[{"role": "user", "content": content}], max_tokens=4
        )
    if url.startswith("data:") and ";base64," in url:
        source = {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]}
        with pytest.raises(anthropic.BadRequestError, match=words):
            sup.anthropic().messages.create(
                model="seer",
                max_tokens=4,
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "?"}]}
                ],
            )
    assert sup.client.model("seer").pid == pid


def test_a_body_too_large_and_too_many_images_are_refused(sup):
    import openai
    import psutil

    pid = sup.client.model("seer").pid
    before = psutil.Process(pid).memory_info().rss
    huge = data_url(np.random.default_rng(0).integers(0, 256, 20 * 2**20, dtype=np.uint8).tobytes())
    content = [{"type": "image_url", "image_url": {"url": huge}}, {"type": "text", "text": ASK}]
    with pytest.raises(openai.BadRequestError):
        sup.openai().chat.completions.create(
            model="seer", messages=[{"role": "user", "content": content}], max_tokens=4
        )
    many = [{"type": "image_url", "image_url": {"url": data_url(png(i, size=(8, 8)))}} for i in range(9)]
    with pytest.raises(openai.BadRequestError, match="more than the 8 allowed"):
        sup.openai().chat.completions.create(model="seer", messages=[{"role": "user", "content": many}], max_tokens=4)
    for _ in range(3):  # the bomb again: refused from its header, nothing decoded
        with pytest.raises(openai.BadRequestError, match="pixels allowed"):
            bombed = [{"type": "image_url", "image_url": {"url": data_url(bomb())}}]
            sup.openai().chat.completions.create(model="seer", messages=[{"role": "user", "content": bombed}])
    assert sup.client.model("seer").pid == pid
    assert psutil.Process(pid).memory_info().rss - before < 64 * 2**20  # its RSS stays where it was


def test_a_model_that_reads_text_only_refuses_images_in_each_api(sup):
    import anthropic
    import ollama
    import openai

    image = png(5)
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": ASK}]
    with pytest.raises(openai.BadRequestError, match="does not take images"):
        sup.openai().chat.completions.create(model="reader", messages=[{"role": "user", "content": content}])
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    with pytest.raises(anthropic.BadRequestError, match="does not take images"):
        sup.anthropic().messages.create(
            model="reader",
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": ASK}]}
            ],
        )
    with pytest.raises(ollama.ResponseError, match="does not take images"):
        sup.ollama().chat(model="reader", messages=[{"role": "user", "content": ASK, "images": [image]}])


def test_the_memory_estimate_counts_the_vision_tower(reference):
    """The footprint the supervisor admits a model by (common.footprint: the checkpoint's safetensors headers) holds
    every weight mlx-vlm loads, the vision tower's and projector's with the language model's; an image's tokens are
    prompt tokens, counted in the KV cache as any."""
    from mlx.utils import tree_flatten
    from mlx_vlm import load

    from common.footprint import ModelFootprint

    model, _ = load(str(VISION_MODEL))
    loaded = sum(value.size for _, value in tree_flatten(model.parameters()))
    vision = sum(value.size for _, value in tree_flatten(model.vision_model.parameters()))
    footprint = ModelFootprint.of(VISION_MODEL)
    assert footprint.parameters == loaded and vision > 0
    assert footprint.layers == 2 and footprint.kv_heads == 1  # the language model's, for the KV cache


@pytest.mark.parametrize("family", ["qwen2_vl", "idefics3"])
def test_the_estimate_covers_the_vision_towers_encode(family):
    """What encoding an image takes past the tower's weights (MLX's peak on this CPU, float32), against the
    estimate's vision transient (common.footprint.VisionFootprint): at least it, and not more than 1.5x it. Towers
    of mid size (width 256, 4 heads, 2 blocks) from mlx-vlm's classes, 1024 patches: Qwen2-VL's dynamic resolution
    (one 448x448 image, its processor's configuration) and a fixed-size SigLIP (Idefics3 / SmolVLM: one 512x512
    tile). The estimate as the supervisor makes it: the model's sizes from its config and processor files."""
    import json

    import mlx.core as mx

    from common.footprint import VisionFootprint

    if family == "qwen2_vl":
        from mlx_vlm.models import qwen2_vl

        config = json.loads((QWEN2VL_MODEL / "config.json").read_text())
        config["vision_config"].update(depth=2, embed_dim=256, num_heads=4)
        tower = qwen2_vl.VisionModel(qwen2_vl.VisionConfig.from_dict(config["vision_config"]))
        pre = json.loads((QWEN2VL_MODEL / "preprocessor_config.json").read_text()) | {"max_pixels": 448 * 448}
        side = 448 // 14
        inputs = (mx.random.normal((side * side, 3 * 2 * 14 * 14)), mx.array([[1, side, side]]))
    else:
        from mlx_vlm.models import idefics3

        config = json.loads((VISION_MODEL / "config.json").read_text())
        config["vision_config"].update(
            hidden_size=256, num_attention_heads=4, intermediate_size=1024, image_size=512, num_hidden_layers=2
        )
        tower = idefics3.VisionModel(idefics3.VisionConfig.from_dict(config["vision_config"]))
        pre = json.loads((VISION_MODEL / "preprocessor_config.json").read_text())
        inputs = (mx.random.normal((1, 512, 512, 3)),)
    tower.set_dtype(mx.float32)
    mx.eval(tower.parameters(), *inputs)
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(tower(*inputs, output_hidden_states=False))
    measured = mx.get_peak_memory() - before
    estimated = VisionFootprint.of(config, pre).transient(1, 2048 * 2048, "cpu", 4)
    assert measured <= estimated <= 1.5 * measured, (measured, estimated)


def test_images_past_image_pixels_are_scaled_down_and_counted(tmp_path):
    """A model's image_pixels setting bounds what its tower sees: a 448x448 image to a Qwen2-VL that sees at most
    112x112 is scaled down to it (16 image tokens, as a 112x112 image gives), where the processor's own cap
    (max_pixels) is higher; and the supervisor's estimate counts the tower's encode at that bound."""
    import json
    import shutil

    from common.footprint import ModelFootprint, estimate

    folder = tmp_path / "qwen2_vl"
    shutil.copytree(QWEN2VL_MODEL, folder)
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(pre | {"max_pixels": 1024 * 1024}))
    footprint = ModelFootprint.of(folder)
    small, large = (estimate([footprint], "float32", "cpu", images=2, image_pixels=p).vision for p in (112**2, 448**2))
    assert 0 < small < large
    (tmp_path / "sup").mkdir()
    sup = SupervisorProcess(tmp_path / "sup", model_toml("q", target=folder, draft=None, image_pixels=112 * 112))
    sup.wait_ready(180)
    try:
        _, _, large = grpc_answer(sup, png(80, size=(448, 448)), "q")
        _, _, small = grpc_answer(sup, png(80, size=(112, 112)), "q")
    finally:
        assert sup.stop() == 0
    assert large.stats.prompt_tokens == small.stats.prompt_tokens


def test_the_disk_tier_keeps_an_image_prefix_across_a_restart(tmp_path, reference):
    """With prompt_cache_dir, a prefix that holds an image outlives its runner: the next supervisor's first request
    about the same image takes the prefix from disk (keyed by the image's digest) and answers as before."""
    image = png(30)
    system = "You describe pictures. " * 60  # past the disk tier's smallest entry (runner.prompt_disk)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": ASK, "images": [image]}]
    toml = model_toml("seer", target=VISION_MODEL, draft=None, prompt_cache_dir=str(tmp_path / "disk"))

    def answer(sup, picture=image):
        chunks = list(
            sup.client.generate(
                timeout=60,
                model="seer",
                messages=[messages[0], {**messages[1], "images": [picture]}],
                max_tokens=TOKENS,
            )
        )
        return [t for c in chunks for t in c.token_ids], chunks[-1].stats

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    first = SupervisorProcess(tmp_path / "one", toml).wait_ready(180)
    try:
        tokens, stats = answer(first)
        assert stats.prompt_tokens > 256 and stats.cached_tokens == 0
    finally:
        assert first.stop() == 0
    second = SupervisorProcess(tmp_path / "two", toml).wait_ready(180)
    try:
        again, cached = answer(second)
        assert again == tokens and cached.cached_tokens == stats.prompt_tokens - 1
        _, other = answer(second, png(31))  # another image after the same system text: only the text is shared
        assert other.cached_tokens < stats.prompt_tokens - 16
    finally:
        assert second.stop() == 0


@pytest.mark.parametrize(
    ("model", "folder"), [("looker", LLAVA_MODEL), ("gazer", GEMMA3_MODEL), ("viewer", MISTRAL3_MODEL)]
)
def test_other_families_answer_as_mlx_vlm_does(sup, model, folder):
    """LLaVA-1.5's layout (a CLIP tower, a projector, a llama), Gemma 3's (SigLIP, a pooling projector, gemma3 with
    its sliding layers) and Mistral 3's (Pixtral, its patch merger, a mistral): alone, batched, and a second turn
    from the cache, as mlx-vlm's generate answers."""
    reference = mlx_vlm_reference(folder)
    image = png(40)
    ids, text, last = grpc_answer(sup, image, model)
    assert ids == reference(image) and ids != reference(png(41))
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": ASK}]
    answer = sup.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
    )
    assert answer.choices[0].message.content == text
    assert answer.usage.prompt_tokens_details.cached_tokens == last.stats.prompt_tokens - 1
    images = [png(42 + i, size=(30 + 10 * i, 50)) for i in range(3)]
    with ThreadPoolExecutor(len(images)) as pool:
        batched = list(pool.map(lambda picture: grpc_answer(sup, picture, model)[0], images))
    assert batched == [reference(picture) for picture in images]


@pytest.mark.parametrize(
    ("model", "folder"),
    [
        ("qwen", QWEN2VL_MODEL),
        ("qwen25", QWEN25VL_MODEL),
        ("qwen3vl", QWEN3VL_MODEL),
        ("qwen3vlmoe", QWEN3VLMOE_MODEL),
        ("qwen35", QWEN35_MODEL),
    ],
)
def test_qwen_vl_positions_answer_as_mlx_vlm_does(sup, model, folder):
    """Qwen2-VL's and Qwen2.5-VL's M-RoPE: an image's tokens take its grid as positions, and the text after it goes
    on from the largest + 1 (the models are built so that plain positions give other tokens: a server that ignored
    M-RoPE fails here). Qwen3-VL adds deepstack features after its first layers (the model is built so that
    dropping them gives other tokens too), here prefilled in parts of 16 tokens that split its image. Qwen3.5's is
    hybrid (Gated DeltaNet layers between its attention layers) and thinks (its
    template opens the reasoning). As mlx-vlm's generate answers: alone; drafted by a model (verify passes at the
    delta); a second turn from the prompt cache; two images of different sizes; batched with each other and with
    text requests (a delta per row, 0 for text)."""
    reference = mlx_vlm_reference(folder)
    image = png(50, size=(112, 112))
    expected = reference(image)
    ids, text, last = grpc_answer(sup, image, model, drafter="none")
    assert ids == expected and ids != reference(png(51, size=(112, 112)))
    if model == "qwen3vl":  # its image's tokens and deepstack features split across prefill parts of 16
        assert len(last.stats.prefill_chunks) >= 2, last.stats.prefill_chunks
    if model in ("qwen", "qwen35"):  # Qwen3.5's hybrid layers are restored from a snapshot on a rejected draft
        drafted, _, stats = grpc_answer(sup, png(52, size=(112, 112)), model, drafter="model", num_draft_tokens=3)
        assert drafted == reference(png(52, size=(112, 112))) and stats.stats.drafted > 0
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": ASK}]
    answer = sup.openai().chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
    )
    assert answer.choices[0].message.content == text
    if model != "qwen35":
        assert answer.usage.prompt_tokens_details.cached_tokens == last.stats.prompt_tokens - 1
    else:  # a hybrid's state cannot be trimmed back: a prompt past 512 tokens leaves its prefill in the cache
        system = {"role": "system", "content": "You describe pictures. " * 120}
        asked = [system, {"role": "user", "content": content}]
        first, again = (
            sup.openai().chat.completions.create(model=model, messages=asked, temperature=0, max_tokens=TOKENS)
            for _ in range(2)
        )
        assert first.usage.prompt_tokens > 512 and first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        assert again.choices[0].message.reasoning_content == first.choices[0].message.reasoning_content
        assert first.choices[0].message.reasoning_content  # Qwen3.5 thinks: its tokens are reasoning, apart
    small, big = png(53, size=(112, 56)), png(54, size=(112, 112))
    two, _, _ = grpc_answer(sup, [small, big], model)
    assert two == mlx_vlm_reference(folder, images=2)(small, big)
    images = [png(55 + i, size=(56 + 28 * i, 112)) for i in range(3)]
    prompts = ["Say something.", "Count to three."]
    alone = [
        sup.openai().completions.create(model=model, prompt=p, temperature=0, max_tokens=TOKENS).choices[0].text
        for p in prompts
    ]
    with ThreadPoolExecutor(len(images) + len(prompts)) as pool:
        seen = [pool.submit(lambda picture: grpc_answer(sup, picture, model)[0], picture) for picture in images]
        read = [
            pool.submit(
                lambda p: (
                    sup.openai()
                    .completions.create(model=model, prompt=p, temperature=0, max_tokens=TOKENS)
                    .choices[0]
                    .text
                ),
                p,
            )
            for p in prompts
        ]
        assert [f.result() for f in seen] == [reference(picture) for picture in images]
        assert [f.result() for f in read] == alone


@pytest.fixture(scope="module")
def image_server():
    """A stand-in for a web server that holds images (nothing public can be reached from here): on loopback, so
    only a model whose image_url_hosts names 127.0.0.1 may fetch from it."""
    import http.server
    import threading

    image = png(50)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/cat.png":
                body, status, headers = image, 200, {"Content-Type": "image/png"}
            elif self.path == "/redirect":
                body, status, headers = b"", 302, {"Location": "/cat.png"}
            elif self.path == "/big":
                body, status, headers = b"x" * (6 * 2**20), 200, {"Content-Type": "image/png"}
            else:
                body, status, headers = b"no", 404, {}
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", image
    server.shutdown()


def test_image_urls_are_fetched_only_where_allowed_and_never_from_a_private_address(sup, image_server):
    import openai

    base, image = image_server

    def ask(model, url):
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": ASK}]
        return sup.openai().chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=TOKENS
        )

    with pytest.raises(openai.BadRequestError, match="image_urls setting is off"):
        ask("seer", f"{base}/cat.png")
    for url in (f"{base}/cat.png", base.replace("127.0.0.1", "localhost") + "/cat.png"):
        with pytest.raises(openai.BadRequestError, match="is not a public address"):
            ask("fetcher", url)
    fetched = ask("intranet", f"{base}/cat.png").choices[0].message.content
    assert fetched == grpc_answer(sup, image, "intranet")[1]  # the same answer as the image sent as data
    for path, words in (("/redirect", "redirects are not followed"), ("/big", "more than"), ("/none", "answered 404")):
        with pytest.raises(openai.BadRequestError, match=words):
            ask("intranet", base + path)


def test_images_of_different_sizes_are_keyed_each_by_its_own_tokens(sup):
    """Mistral 3's images take as many tokens as their size gives (8 for 112x56, 16 for 112x112): the prompt cache
    keys each image's own tokens by its digest, so a request whose second image differs reuses nothing of it, and
    answers as mlx-vlm does."""
    reference = mlx_vlm_reference(MISTRAL3_MODEL, images=2)
    small, big, other = png(70, size=(112, 56)), png(71, size=(112, 112)), png(72, size=(112, 112))
    first, _, _ = grpc_answer(sup, [small, big], "viewer")
    assert first == reference(small, big)
    second, _, _ = grpc_answer(sup, [small, other], "viewer")  # the first image's prefix is cached, not the second's
    assert second == reference(small, other)


def test_an_image_answer_goes_on_after_its_runner_dies(sup):
    """A runner killed mid-answer about an image: the restarted runner gets the image again with the tokens sent
    so far (resume_ids) and goes on, at the positions M-RoPE gives text after an image (Qwen2-VL); the client
    reads one answer, the same as an uninterrupted one. (Last in this file: it restarts a runner of the shared
    supervisor.)"""
    image = png(90, size=(112, 112))
    messages = [{"role": "user", "content": ASK, "images": [image]}]
    fields = dict(model="qwen25", messages=messages, max_tokens=600, ignore_eos=True, drafter="none")
    whole = [t for c in sup.client.generate(timeout=120, **fields) for t in c.token_ids]
    victim = sup.client.model("qwen25")
    call = sup.client.generate(timeout=120, **fields)
    chunks = [next(call)]
    os.kill(victim.pid, signal.SIGKILL)
    resumed_on_a_new_runner(sup, "qwen25", victim.pid)
    chunks += list(call)
    assert [t for c in chunks for t in c.token_ids] == whole
    assert chunks[-1].stats.generated_tokens == 600
