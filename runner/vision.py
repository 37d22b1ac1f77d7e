"""A model that sees (issue #39): a vision-language checkpoint, its images turned into the text model's input.

A checkpoint whose ``config.json`` has a ``vision_config`` is loaded with mlx-vlm (``mlx_vlm.load``: its model
classes, its processor). The runner decodes with mlx-lm's class for the language model, built from the
checkpoint's ``text_config`` and holding the same weight arrays (nothing copied), so a text-only request to such a
model is a text request like any other: speculation, the prompt cache, batching, grammars, tools and reasoning
work unchanged. Families whose language model positions its tokens as a plain decoder does (SmolVLM / Idefics3,
LLaVA-style, Gemma 3, Mistral 3) are served so; Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5, whose image tokens
take positions of their own (M-RoPE), are served with the positions mlx-vlm computes for the prompt, and
Qwen3-VL with its deepstack features (``runner.mrope``).

An image request is laid out by the model's chat template (each message as parts: its images, then its text),
and mlx-vlm's processor expands each image into its image tokens and computes its pixels. What the prompt cache
keys on is the prompt with each image's tokens replaced by ids beyond the vocabulary derived from the image's
digest (``VisionInput.key_ids``): the same image in the same place is the same prefix, another image is not, so a
chat that goes on about one image reuses its prefill (the image's features are in the cached keys and values) and
encodes it once. The model only ever sees the real ids: the prefill of a prompt part that holds images runs on
the embeddings mlx-vlm computes (``embeddings``), the rest on ids.
"""

from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest, ModelLoadError
from common.images import URL_IMAGE, Limits, check, digest, fetch, scaled

from . import mrope

# Language models whose token positions are those of a plain decoder (images are runs of tokens): mlx-lm's class
# for them decodes the checkpoint's text.
PLAIN_POSITIONS = ("smolvlm", "idefics3", "idefics2", "llava", "gemma3", "mistral3")
KEY_SPACE = 2**24  # image ids in the prompt cache's keys: vocab_size + a digest's first 3 bytes
COUNTS_KEPT = 4096  # images whose token counts are remembered


def is_vision(folder: Path) -> bool:
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict)


@dataclass(frozen=True)
class VisionInput:
    """An image request's prompt as the model takes it."""

    real_ids: list[int]  # the prompt's tokens (each image's as the processor expands them)
    pixels: dict  # the processor's pixel values and their masks (numpy), for get_input_embeddings
    last_image: int  # the last image token's position: a prefill from past it needs no image
    # M-RoPE (runner.mrope): each prompt token's (time, row, column) positions, (3, L), and the delta that the
    # positions after the prompt add to their index; None and 0 for a model whose positions are plain.
    positions: np.ndarray | None = None
    rope_delta: int = 0

    def resumed(self, answer: list[int]) -> VisionInput:
        """This prompt followed by an answer another runner started (``resume_ids``): text after the last image,
        at its index plus the delta where positions are M-RoPE's."""
        if not answer:
            return self
        positions = self.positions
        if positions is not None:
            start = len(self.real_ids) + self.rope_delta
            more = np.arange(start, start + len(answer), dtype=positions.dtype)
            positions = np.concatenate([positions, np.broadcast_to(more, (positions.shape[0], len(answer)))], axis=1)
        pixels = dict(self.pixels)
        if "mask" in pixels:  # the processor's attention mask covers the prompt: the answer is attended too
            mask = pixels["mask"]
            pixels["mask"] = np.concatenate([mask, np.ones((mask.shape[0], len(answer)), mask.dtype)], axis=1)
        return replace(self, real_ids=self.real_ids + list(answer), pixels=pixels, positions=positions)


class Vision:
    """mlx-vlm's model (its vision tower, projector and embedding merge) and processor for one checkpoint."""

    def __init__(self, model, processor, config: dict):
        self.model = model
        self.processor = processor
        self.config = config
        self.image_token_id = int(config.get("image_token_id", config.get("image_token_index", -1)))
        self.one_image_prompt = ""  # the template's layout of one image alone (warm_up): an image's token count
        self.positions: mrope.Positions | None = None  # M-RoPE's positions, read by the text model (load)
        self._counts: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # digest -> its tokens
        self._lock = threading.Lock()  # requests are prepared on gRPC threads

    def input(
        self, prompt: str, pictures: list[bytes], limits: Limits, vocab_size: int
    ) -> tuple[list[int], VisionInput]:
        """(the prompt cache's key ids, the model's input) for a prompt text laid out by the chat template with one
        image marker per image, in order; an image over a limit or that cannot be decoded is refused naming it."""
        if len(pictures) > limits.images:
            raise InvalidRequest("messages", f"{len(pictures)} images, more than the {limits.images} allowed")
        pictures = [  # an image given by URL: fetched (where allowed), then keyed and checked as any
            fetch(data[len(URL_IMAGE) :].decode(errors="replace"), limits, f"image {i}")
            if data.startswith(URL_IMAGE)
            else data
            for i, data in enumerate(pictures)
        ]
        decoded = [scaled(check(data, limits, f"image {i}"), limits.seen) for i, data in enumerate(pictures)]
        try:
            out = self.processor(text=[prompt], images=decoded, return_tensors="np")
        except Exception as error:  # noqa: BLE001 - the processor's own refusal (a template without image markers)
            raise InvalidRequest("messages", f"the model's processor refused the images: {error}") from None
        ids = [int(t) for t in np.asarray(out["input_ids"])[0]]
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if not positions:
            raise InvalidRequest("messages", "the chat template laid out no image (it does not take images)")
        keys = list(ids)
        counts = [self._count(data, image) for data, image in zip(pictures, decoded)]
        if sum(counts) == len(positions):  # each image's tokens keyed by its digest, in order
            owners = [i for i, count in enumerate(counts) for _ in range(count)]
            digests = [digest(data) for data in pictures]
        else:  # a processor whose counts do not add up: every image token keyed by all the images together
            owners, digests = [0] * len(positions), [digest(b"".join(digest(data) for data in pictures))]
        for owner, position in zip(owners, positions):
            keys[position] = vocab_size + int.from_bytes(digests[owner][:3], "big") % KEY_SPACE
        # As numpy here (some processors answer in MLX arrays, evaluated now, on this request's thread); the MLX
        # thread makes them MLX arrays when it encodes (``embeddings``).
        pixels = {
            name: np.asarray(value)
            for name, value in out.items()
            if name not in ("input_ids", "attention_mask") and value is not None
        }
        if out.get("attention_mask") is not None:  # as mlx-vlm's generate passes it (Gemma 3 builds its mask from it)
            pixels["mask"] = np.asarray(out["attention_mask"])
        if self.positions is None:
            return keys, VisionInput(ids, pixels, positions[-1])
        explicit, deltas = self.model.language_model.get_rope_index(
            mx.array(ids)[None], image_grid_thw=mx.array(pixels["image_grid_thw"])
        )
        explicit = np.asarray(explicit)[:, 0, :]  # (3, L): evaluated here, on this request's thread
        return keys, VisionInput(ids, pixels, positions[-1], explicit, int(np.asarray(deltas).reshape(-1)[0]))

    def _count(self, data: bytes, image) -> int:
        """How many image tokens ``image`` takes (processed alone, once per image: remembered by its digest)."""
        key = digest(data)
        with self._lock:
            count = self._counts.get(key)
            if count is not None:
                self._counts.move_to_end(key)
                return count
        out = self.processor(text=[self.one_image_prompt], images=[image], return_tensors="np")
        count = int((np.asarray(out["input_ids"])[0] == self.image_token_id).sum())
        with self._lock:
            self._counts[key] = count
            while len(self._counts) > COUNTS_KEPT:
                self._counts.popitem(last=False)
        return count

    def warm_up(self, tokenizer, vocab_size: int) -> None:
        """Encode one small image now, on the loading thread: what a model computes and keeps on its first image
        (Pixtral's rotary tables) is then evaluated here, not left as lazy work for the decoding thread (an MLX
        stream is its thread's own); and a processor or template that cannot take an image fails the load."""
        import io

        from PIL import Image

        picture = io.BytesIO()
        Image.new("RGB", (32, 32), (128, 64, 32)).save(picture, "PNG")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        self.one_image_prompt = prompt
        _, vision_input = self.input(prompt, [picture.getvalue()], Limits(), vocab_size)
        mx.eval([part for part in self.embeddings(vision_input) if part is not None])

    def embeddings(self, vision_input: VisionInput) -> tuple[mx.array, mx.array | None]:
        """The whole prompt's input embeddings (1, L, hidden), the images' features where their tokens are; and
        Qwen3-VL's deepstack features as the layers add them ((layers, L, hidden): zeros but at image tokens), or
        None."""
        ids = mx.array(vision_input.real_ids)[None]
        pixels = {name: mx.array(value) for name, value in vision_input.pixels.items()}
        values = pixels.pop("pixel_values")
        out = self.model.get_input_embeddings(ids, values, **pixels)
        embedded = getattr(out, "inputs_embeds", out)
        features = getattr(out, "deepstack_visual_embeds", None)
        if features is None or len(features) == 0:
            return embedded, None
        rows = mx.array(np.flatnonzero(np.asarray(out.visual_pos_masks)[0]))
        dense = mx.zeros((len(features), ids.shape[1], embedded.shape[-1]), embedded.dtype)
        dense[:, rows] = mx.stack(list(features)).astype(embedded.dtype)
        return embedded, dense


def _hidden_arrays(model) -> list:
    """Arrays a model keeps outside its parameters (Pixtral's rotary frequencies, ``_inv_freq`` and such), which a
    lazy computation at load would leave for the decoding thread, whose streams are its own."""
    out = []
    for module in model.modules():
        for value in list(vars(module).values()) + list(module.values()):
            if isinstance(value, mx.array):
                out.append(value)
    return out


def load(folder: Path, dtype: str):
    """(text model, tokenizer, text config, Vision) for a vision-language checkpoint; ModelLoadError otherwise."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import _get_classes
    from mlx_vlm import load as vlm_load

    config = json.loads((Path(folder) / "config.json").read_text())
    kind = config.get("model_type", "")
    if kind not in PLAIN_POSITIONS and kind not in mrope.TEXT_MODEL:
        served = ", ".join((*PLAIN_POSITIONS, *mrope.TEXT_MODEL))
        raise ModelLoadError(folder, f"a {kind!r} vision model is not served yet (served: {served})")
    model, processor = vlm_load(str(folder))
    if dtype == "float32":
        model.set_dtype(mx.float32)
    if isinstance(config.get("text_config"), dict):
        text_config = dict(config["text_config"])
    else:  # Qwen2-VL's layout: the text model's keys at the top level
        text_config = {k: v for k, v in config.items() if k != "vision_config"}
    if kind in mrope.TEXT_MODEL:  # mlx-lm's class for the language model ("qwen2_5_vl_text" and such are not one)
        text_config["model_type"] = mrope.TEXT_MODEL[kind]
    text_config.setdefault("vocab_size", config.get("vocab_size"))
    # Tied or not as mlx-vlm reads it (a missing key is False there, True in mlx-lm's llama: Mistral 3's config).
    tied = getattr(getattr(model.config, "text_config", None), "tie_word_embeddings", None)
    text_config.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False) if tied is None else tied)
    model_class, args_class = _get_classes(text_config)
    text = model_class(args_class.from_dict(text_config))
    ours = {name for name, _ in tree_flatten(text.parameters())}
    weights = []
    for name, value in tree_flatten(model.language_model.parameters()):  # mlx-vlm's names, as mlx-lm's
        # mlx-lm's name: the same, under "model." (mlx-vlm's language model is mlx-lm's inner one), or under
        # "language_model." (mlx-lm's class for a multimodal checkpoint's text: Qwen3.5's)
        place = next((n for n in (name, f"model.{name}", f"language_model.{name}") if n in ours), None)
        if place is not None:
            weights.append((place, value))
        elif name != "lm_head.weight":  # mlx-vlm keeps a copy of tied embeddings as a head (Gemma 3's)
            raise ModelLoadError(folder, f"the language model's {name} has no place in mlx-lm's {kind} text model")
    text.load_weights(weights, strict=True)  # the same arrays: nothing copied
    assert isinstance(text, nn.Module)
    mx.eval(model.parameters())
    mx.eval(_hidden_arrays(model))  # computed at load: evaluated here, not lazily on the thread that decodes
    tokenizer = load_tokenizer(Path(folder), eos_token_ids=config.get("eos_token_id"))
    text_config.setdefault("max_position_embeddings", 8192)
    vision = Vision(model, processor, config)
    if kind in mrope.TEXT_MODEL:
        deepstack = len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())
        vision.positions = mrope.install(text, model.language_model, deepstack)
    try:
        vision.warm_up(tokenizer, int(text_config.get("vocab_size") or config.get("vocab_size") or 0))
    except Exception as error:  # noqa: BLE001 - reported with the folder
        raise ModelLoadError(folder, f"it cannot encode an image: {type(error).__name__}: {error}") from error
    return text, tokenizer, text_config, vision
