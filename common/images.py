"""Images a request carries (a model that sees: issue #39): read from each API's form, and checked before anything
decodes them.

MLX-free (the supervisor reads an API's parts; the runner checks and decodes them for the model). Each API sends
an image its own way: a ``data:`` URL (OpenAI's ``image_url``, the Responses API's ``input_image``), base64 with
a media type (Anthropic's ``image`` blocks), bare base64 (Ollama's ``images``), or bytes (gRPC). An ``http(s)``
URL travels to the runner as itself (``url_image``: bytes no image begins with) and is fetched there only where
the model's ``image_urls`` setting is "public" (off by default): a server that fetches what a client names can be
pointed at its own network, so ``fetch`` resolves the host itself, refuses any address that is not public
(loopback, private, link-local, reserved: ``ip.is_global``) unless the host is named in ``image_url_hosts``,
connects to the address it checked (no second lookup to rebind), follows no redirect, and stops at
``max_image_bytes`` and at a time limit.

``check`` reads an image's header first (Pillow reads the size without decoding the pixels), so an image that
claims more pixels than ``max_image_pixels`` (a decompression bomb: a small PNG that claims 100k x 100k) is
refused before its pixels are decoded; then decodes it whole, so a truncated file is refused here, not in the
model. Animated images and formats Pillow does not decode (SVG) are refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import ipaddress
import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from .errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what an image may be (Pillow's names)
URL_IMAGE = b"\x00image-url\x00"  # an image given by its URL, as it travels to the runner: url_image
FETCH_SECONDS = 10.0  # the most one image URL's fetch may take, connection and body


@dataclass(frozen=True)
class Limits:
    images: int = 8  # per request
    bytes: int = 5 * 2**20  # per image, encoded
    pixels: int = 25_000_000  # per image
    seen: int = 1024 * 1024  # the most pixels of an image the model sees (``scaled``)
    urls: str = "off"  # http(s) image URLs: "off" (refused) or "public" (fetched from public addresses)
    url_hosts: tuple[str, ...] = ()  # hosts fetched even at a private address (an internal image server)


def from_base64(text: str, where: str, field: str = "messages") -> bytes:
    """An image's bytes from base64 text; refused naming ``where`` (the part)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, f"{where}: the image is not valid base64") from None


def url_image(url: str) -> bytes:
    """An http(s) image URL as it travels to the runner, which fetches it if the model's setting allows."""
    return URL_IMAGE + url.encode()


def from_url(url: str, where: str, field: str = "messages") -> bytes:
    """An image's bytes from a ``data:`` URL (``data:image/png;base64,...``), or an http(s) URL to be fetched
    (``url_image``); any other URL is refused."""
    if url.startswith(("http://", "https://")):
        return url_image(url)
    if not url.startswith("data:"):
        raise InvalidRequest(field, f"{where}: an image must be a data: URL (data:image/png;base64,...)")
    header, _, data = url.partition(",")
    if not header.endswith(";base64"):
        raise InvalidRequest(field, f"{where}: a data: URL's image must be base64 (data:image/png;base64,...)")
    return from_base64(data, where, field)


def digest(data: bytes) -> bytes:
    """An image's identity, for the prompt cache (the same bytes: the same image)."""
    return hashlib.sha256(data).digest()


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the address already checked, the certificate checked against the URL's host."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self):
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def fetch(url: str, limits: Limits, where: str, field: str = "messages", seconds: float = FETCH_SECONDS) -> bytes:
    """An image URL's bytes, under the guards above; InvalidRequest naming ``where`` otherwise."""
    if limits.urls != "public":
        raise InvalidRequest(
            field,
            f"{where}: image URLs are not fetched for this model (its image_urls setting is off): send the image "
            "itself, as a data: URL",
        )
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError):
        raise InvalidRequest(field, f"{where}: the image URL's host {host!r} cannot be resolved") from None
    addresses = sorted({info[4][0] for info in infos})
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%")[0])
        if not ip.is_global and host not in limits.url_hosts:
            raise InvalidRequest(field, f"{where}: the image URL's host {host!r} is not a public address ({ip})")
    deadline = time.monotonic() + seconds
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        if parts.scheme == "https":
            connection = _PinnedHTTPS(host, addresses[0], port, seconds)
        else:
            connection = http.client.HTTPConnection(addresses[0], port, timeout=seconds)
        connection.request("GET", path, headers={"Host": parts.netloc, "Accept": "image/*", "User-Agent": "mlxserve"})
        response = connection.getresponse()
        if response.status != 200:  # a redirect too: it could lead anywhere
            raise InvalidRequest(
                field, f"{where}: the image URL answered {response.status} (redirects are not followed)"
            )
        declared = response.getheader("Content-Length")
        if declared and declared.isdigit() and int(declared) > limits.bytes:
            raise InvalidRequest(field, f"{where}: the image is {declared} bytes, more than the {limits.bytes} allowed")
        body = bytearray()
        while True:
            if time.monotonic() > deadline:
                raise InvalidRequest(field, f"{where}: the image URL took more than {seconds:g} s")
            piece = response.read(65536)
            if not piece:
                break
            body += piece
            if len(body) > limits.bytes:
                raise InvalidRequest(field, f"{where}: the image is more than the {limits.bytes} bytes allowed")
        connection.close()
        return bytes(body)
    except (OSError, http.client.HTTPException) as error:
        raise InvalidRequest(field, f"{where}: the image URL could not be fetched ({error})") from None


def check(data: bytes, limits: Limits, where: str, field: str = "messages"):
    """The image decoded (an RGB ``PIL.Image``), or InvalidRequest naming ``where`` and why (an image URL is
    fetched before: runner.vision)."""
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


def scaled(image, pixels: int):
    """``image`` (a PIL image) at most ``pixels`` pixels: scaled down, its aspect kept, where it has more."""
    width, height = image.size
    if width * height <= pixels:
        return image
    from PIL import Image

    factor = (pixels / (width * height)) ** 0.5
    return image.resize((max(1, int(width * factor)), max(1, int(height * factor))), Image.BICUBIC)
