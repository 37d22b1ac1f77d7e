"""Images a request carries (a model that sees: issue #39): read from each API's form, and checked before anything
decodes them.

MLX-free (the supervisor reads an API's parts; the runner checks and decodes them for the model). Each API sends
an image its own way: a ``data:`` URL (OpenAI's ``image_url``, the Responses API's ``input_image``), base64 with
a media type (Anthropic's ``image`` blocks), bare base64 (Ollama's ``images``), or bytes (gRPC). ``http(s)`` URLs
are not fetched: a server that fetches what a client names can be pointed at its own network (a loopback or
private address), so it is refused until a fetch that guards against that is built.

``check`` reads an image's header first (Pillow reads the size without decoding the pixels), so an image that
claims more pixels than ``max_image_pixels`` (a decompression bomb: a small PNG that claims 100k x 100k) is
refused before its pixels are decoded; then decodes it whole, so a truncated file is refused here, not in the
model. Animated images and formats Pillow does not decode (SVG) are refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass

from .errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what an image may be (Pillow's names)


@dataclass(frozen=True)
class Limits:
    images: int = 8  # per request
    bytes: int = 5 * 2**20  # per image, encoded
    pixels: int = 25_000_000  # per image


def from_base64(text: str, where: str, field: str = "messages") -> bytes:
    """An image's bytes from base64 text; refused naming ``where`` (the part)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, f"{where}: the image is not valid base64") from None


def from_url(url: str, where: str, field: str = "messages") -> bytes:
    """An image's bytes from a ``data:`` URL (``data:image/png;base64,...``); any other URL is refused."""
    if url.startswith(("http://", "https://")):
        raise InvalidRequest(
            field, f"{where}: image URLs are not fetched by this server: send the image itself, as a data: URL"
        )
    if not url.startswith("data:"):
        raise InvalidRequest(field, f"{where}: an image must be a data: URL (data:image/png;base64,...)")
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidRequest(field, f"{where}: a data: URL's image must be base64 (data:image/png;base64,...)")
    return from_base64(data, where, field)


def digest(data: bytes) -> bytes:
    """An image's identity, for the prompt cache (the same bytes: the same image)."""
    return hashlib.sha256(data).digest()


def check(data: bytes, limits: Limits, where: str, field: str = "messages"):
    """The image decoded (an RGB ``PIL.Image``), or InvalidRequest naming ``where`` and why."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.bytes:
        raise InvalidRequest(field, f"{where}: the image is {len(data)} bytes, more than the {limits.bytes} allowed")
    try:
        with Image.open(io.BytesIO(data)) as probe:  # the header only: nothing decoded yet
            kind, (width, height) = probe.format, probe.size
            frames = getattr(probe, "n_frames", 1)
    except Image.DecompressionBombError:  # Pillow's own bound (far above ours) refuses its header outright
        raise InvalidRequest(field, f"{where}: the image claims more than the {limits.pixels} pixels allowed") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(field, f"{where}: not an image this server decodes ({', '.join(FORMATS)})") from None
    if kind not in FORMATS:
        raise InvalidRequest(field, f"{where}: {kind} images are not taken ({', '.join(FORMATS)} are)")
    if width * height > limits.pixels:
        raise InvalidRequest(
            field, f"{where}: the image is {width}x{height}, more than the {limits.pixels} pixels allowed"
        )
    if frames > 1:
        raise InvalidRequest(field, f"{where}: an animated image ({frames} frames) is not taken: send one frame")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()  # the whole file: a truncated one fails here
            return image.convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        raise InvalidRequest(field, f"{where}: the image cannot be decoded ({error})") from None
