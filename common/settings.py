"""A runner's settings: one description, validated once, read from the config file or the runner's command line.

``RunnerSettings`` names every setting of one runner process, with its default and its check, once. The
supervisor reads a model's table of the TOML config into it (``from_table``), turns it into the runner's
command line (``to_argv``: ``--key-with-dashes VALUE`` for each value that is not the default), and the runner
parses that back (``add_arguments``, ``from_namespace``) into the same object, which its engine, worker and gRPC
server read. A person starting a runner by hand uses the same flags. Every problem is one ``SettingsError``
naming the key.

Sizes take a number of bytes or a string such as ``512MiB`` or ``2GB``; durations a number of seconds or a
string such as ``30s`` or ``5m``. Importable without MLX.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .defaults import (
    CPU_PREFILL_CHUNK,
    DEFAULT_DTYPE,
    DEFAULT_GRACE,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_DRAFT_TOKENS,
    DEFAULT_MAX_PENDING_ROUNDS,
    DEFAULT_MAX_QUEUE,
    DEFAULT_NGRAM_MAX,
    DEFAULT_NGRAM_MIN,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFILL_SCORE_BYTES,
    DEFAULT_PROMPT_CACHE_DISK,
    DEFAULT_RELEASE_INTERVAL,
    DEFAULT_STALL_AFTER,
    DEFAULT_STREAM_INTERVAL,
    DTYPES,
    MAX_NUM_DRAFT_TOKENS,
)
from .reasoning import FORMATS as REASONING_FORMATS
from .tool_calls import FORMATS as TOOL_FORMATS

DRAFTERS = ("model", "mtp", "head", "block", "ngram", "none")
KV_BITS = (8, 4)  # what a quantized KV cache may take (runner/kv_quant.py)
KV_GROUP_SIZES = (32, 64, 128)

CACHE_LIMIT_DEFAULT = "default"  # MLX's own pool cap
CACHE_LIMIT_UNBOUNDED = "unbounded"  # the memory limit (what Metal and CUDA default to)


class SettingsError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.message = message


# -- values ---------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "m": 1000**2,
    "g": 1000**3,
    "t": 1000**4,
    "ki": 1024,
    "mi": 1024**2,
    "gi": 1024**3,
    "ti": 1024**4,
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}


def parse_size(key: str, value) -> int:
    if isinstance(value, bool):
        raise SettingsError(key, "expected a size such as 512MiB or 2GB")
    if isinstance(value, int):
        if value < 0:
            raise SettingsError(key, "must not be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise SettingsError(key, f"{value!r} is not a size such as 512MiB or 2GB")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_duration(key: str, value) -> float:
    if isinstance(value, bool):
        raise SettingsError(key, "expected a duration such as 30s or 5m")
    if isinstance(value, (int, float)):
        if value < 0:
            raise SettingsError(key, "must not be negative")
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise SettingsError(key, f"{value!r} is not a duration such as 30s or 5m")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def check_type(key: str, value, kind: type):
    """``value`` as a ``kind`` (an int is a float too, a bool is no number), else SettingsError."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise SettingsError(key, f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _typed(kind: type):
    return lambda key, value: check_type(key, value, kind)


def _path(key: str, value) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise SettingsError(key, "expected a path")
    return Path(value)


def _auto_or_number(low: int, high: float, expected: str):
    """A parser for "auto" (None) or a whole number in [low, high], refused as ``must be "auto" or <expected>``."""

    def parse(key: str, value) -> int | None:
        if value == "auto" or value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise SettingsError(key, f'must be "auto" or {expected}')
        return value

    return parse


_chunk = _auto_or_number(1, math.inf, "a positive number")
_depth = _auto_or_number(0, MAX_NUM_DRAFT_TOKENS, f"a number in [0, {MAX_NUM_DRAFT_TOKENS}]")


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _adapters(key: str, value) -> str:
    """LoRA adapters: a table ``{name = "folder"}`` or ``name=folder,name=folder``, kept as the latter."""
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, str):
        pairs = [item.split("=", 1) if "=" in item else (item, "") for item in value.split(",") if item]
    else:
        raise SettingsError(key, 'expected a table such as {french = "adapters/french"}')
    for name, folder in pairs:
        if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
            raise SettingsError(key, f"{name!r}: an adapter's name is letters, digits, '.', '_' and '-'")
        if not isinstance(folder, str) or not folder or "," in folder:
            raise SettingsError(f"{key}.{name}", "expected an adapter folder or a hub repository")
    return ",".join(f"{name}={folder}" for name, folder in pairs)


def adapter_folders(text: str) -> dict[str, str]:
    """The ``adapters`` setting as name -> folder."""
    return dict(item.split("=", 1) for item in text.split(",") if item)


def _ints(key: str, value) -> str:
    """A list of positive integers: ``[512, 256]`` or ``512,256``, kept as the latter."""
    items = [item for item in value.split(",") if item.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        raise SettingsError(key, "expected a list of numbers such as [512, 256]")
    numbers = []
    for item in items:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or item < 1:
            raise SettingsError(key, f"{item!r} is not a positive number")
        numbers.append(item)
    return ",".join(map(str, numbers))


def _cache_limit(key: str, value) -> str | int:
    return value if value in (CACHE_LIMIT_DEFAULT, CACHE_LIMIT_UNBOUNDED) else parse_size(key, value)


def _auto_or_int(text: str) -> str | int:
    return text if text == "auto" else int(text)


# The text form of a value on the command line, for each parser that does not take strings already.
_FROM_TEXT = {"int": int, "float": float, "depth": _auto_or_int, "chunk": _auto_or_int}
_PARSERS = {
    "int": _typed(int),
    "float": _typed(float),
    "bool": _typed(bool),
    "str": _typed(str),
    "path": _path,
    "size": parse_size,
    "duration": parse_duration,
    "depth": _depth,
    "chunk": _chunk,
    "cache_limit": _cache_limit,
    "adapters": _adapters,
    "ints": _ints,
}


MAX_RANKS = 8
PARALLELISMS = ("auto", "tensor", "pipeline")
BACKENDS = ("ring", "nccl")  # what runner.group starts ranks for
BACKENDS_NOT_WIRED = {
    "mpi": " (mpirun starts MPI ranks; mlxserve starts its own)",
    "jaccl": " (JACCL's RDMA device lists are not wired yet; ring runs over Thunderbolt's IP too)",
}


def read_hostfile(path: Path) -> list[list[str]]:
    """MLX's hostfile: a JSON list, per rank, of "host:port" addresses (the ring backend's format)."""
    import json

    try:
        hosts = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise SettingsError("hostfile", f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(hosts, list) or not all(
        isinstance(h, list) and h and all(isinstance(a, str) and a.rpartition(":")[2].isdigit() for a in h)
        for h in hosts
    ):
        raise SettingsError("hostfile", f'{path} is not a list of ["host:port", ...] lists, one per rank')
    return hosts


def setting(default, kind: str, help: str, *, config: bool = True):
    """A field of ``RunnerSettings``: its default, how its value is read (``_PARSERS``), what it means, and
    whether a model's config table takes it (``config=False``: the supervisor sets it itself)."""
    return field(default=default, metadata={"kind": kind, "help": help, "config": config})


@dataclass(frozen=True)
class RunnerSettings:
    target: Path | None = setting(
        None,
        "path",
        "the target model's folder (mlx-lm layout), or a .gguf file in "
        "the supervisor's config (imported once at start-up)",
    )
    draft: Path | None = setting(None, "path", "the draft model's folder (or .gguf); none = no draft model")
    name: str = setting("default", "str", "the model's name, for logs and Info", config=False)
    drafter: str = setting(
        "",
        "str",
        'what drafts: "model" (the draft), "mtp" (the target\'s own MTP layer), "head" (the drafter head in head), '
        '"block" (the block drafter in block), "ngram" (lookup in the context) or "none"; default: model when there '
        "is a draft, else mtp where the target has MTP layers, else head when head is set, else block when block is "
        "set, else ngram",
    )
    block: Path | None = setting(
        None,
        "path",
        "a block drafter's folder (DFlash's layout: runner/drafting/block.py; models/train_block.py trains one): it "
        "drafts up to its block size - 1 tokens in one pass over the target's hidden states; none = no block drafter",
    )
    head: Path | None = setting(
        None,
        "path",
        "an EAGLE-style drafter head's folder (runner/drafting/head.py; python -m models.train_drafter trains one for "
        'a target): one decoder layer over the target\'s hidden states that drafts with drafter = "head" (by default '
        "where there is no draft model and no MTP layer); refused where it was trained for another vocabulary, "
        "width or architecture",
    )
    num_draft_tokens: int | None = setting(
        None, "depth", '"auto": the depth is chosen round by round (runner/drafting/depth.py); a number pins it'
    )
    max_draft_tokens: int = setting(DEFAULT_MAX_DRAFT_TOKENS, "int", 'the deepest round "auto" tries')
    ngram_max: int = setting(DEFAULT_NGRAM_MAX, "int", "the longest context suffix n-gram lookup matches")
    ngram_min: int = setting(DEFAULT_NGRAM_MIN, "int", "the shortest context suffix n-gram lookup matches")
    release_interval: int = setting(
        DEFAULT_RELEASE_INTERVAL, "int", "release MLX's pool when a round's generated count crosses a multiple of this"
    )
    release_enabled: bool = setting(True, "bool", "debug: false never releases the pool (shows the leak)")
    cache_limit: str | int = setting(
        CACHE_LIMIT_DEFAULT, "cache_limit", 'MLX\'s pool cap: "default" (MLX\'s), "unbounded" or a size'
    )
    prefill_chunk: int | None = setting(
        None,
        "chunk",
        f'the most prompt tokens one forward pass takes; "auto": {DEFAULT_PREFILL_CHUNK} on a GPU, '
        f"{CPU_PREFILL_CHUNK} on the CPU (its attention computes the masked half of a chunk's scores)",
    )
    dtype: str = setting(
        DEFAULT_DTYPE,
        "str",
        '"auto" (the checkpoint\'s form on a GPU, float32 on the CPU if it '
        'fits), "checkpoint" (as stored) or "float32"',
    )
    max_context: int = setting(0, "int", "lower the model's context length to this (0 = the model's own)")
    max_output_tokens: int = setting(
        0,
        "int",
        "end every answer after at most this many tokens, whatever max_tokens a request asks (0 = no cap); "
        "told to clients in /v1/models",
    )
    prompt_cache: int | None = setting(
        None,
        "size",
        "bytes of KV caches kept for prefix reuse (0 = off; default: derived from memory, supervisor/memory.py)",
    )
    kv_bits: int = setting(
        0,
        "int",
        "store the target's KV cache quantized to 8 or 4 bits (0 = float); batches run quantized too "
        "(runner/kv_quant.py)",
    )
    kv_group_size: int = setting(64, "int", "values per scale and bias in a quantized KV cache: 32, 64 or 128")
    quantized_kv_start: int = setting(
        0, "int", "a KV cache stays in float until it holds more than this many tokens, then is quantized whole"
    )
    prompt_cache_cold_after: float = setting(
        0.0,
        "duration",
        "prompt-cache entries unused this long are kept 8-bit quantized, and so are the least recently used "
        "ones before any is evicted for room; a hit dequantizes its copy (0 = off; runner/prompt_cache.py)",
    )
    prompt_cache_dir: Path | None = setting(
        None,
        "path",
        "a folder where the prompt cache also keeps its entries, so warm prefixes survive restarts "
        "(runner/prompt_disk.py); none = memory only",
    )
    prompt_cache_disk: int = setting(
        DEFAULT_PROMPT_CACHE_DISK, "size", "bytes the prompt cache's files in prompt_cache_dir may take"
    )
    ranks: int = setting(
        1,
        "int",
        "processes the target is split across (a runner group over MLX's distributed backend; "
        "runner/group.py); 1 = one process",
    )
    parallelism: str = setting(
        "auto",
        "str",
        "how a group splits the target: tensor (every layer's heads, mlx-lm's shard), pipeline (runs of "
        "layers, runner/pipeline.py) or auto (tensor where the model splits evenly, else pipeline)",
    )
    backend: str = setting(
        "ring",
        "str",
        "MLX's distributed backend for a group: ring (TCP; on every build) or nccl (CUDA builds)",
    )
    hostfile: Path | None = setting(
        None,
        "path",
        "a group across hosts: MLX's hostfile (JSON, one list of host:port per rank, rank 0 first); rank 0 "
        "runs here, each other rank under `python -m supervisor worker` on its host. none = every rank on "
        "this host, started by rank 0",
    )
    batch_memory: int | None = setting(
        None,
        "size",
        "bytes the batched requests' caches may take, projected to "
        "their ends; a request that would pass it waits (default: "
        "derived from memory by the supervisor, else no limit)",
    )
    malloc_trim: bool = setting(True, "bool", "give freed heap back to the system after each pool release (glibc)")
    max_queue: int = setting(
        DEFAULT_MAX_QUEUE,
        "int",
        "requests that may wait for a place in the batch; the next is refused (RESOURCE_EXHAUSTED)",
    )
    max_batch: int = setting(DEFAULT_MAX_BATCH, "int", "requests decoded together at most (1 = one at a time)")
    max_pending_rounds: int = setting(
        DEFAULT_MAX_PENDING_ROUNDS,
        "int",
        "rounds that may wait for a client that reads slowly; past them its request ends (RESOURCE_EXHAUSTED) and "
        "its row goes to others",
    )
    stream_interval: float = setting(
        DEFAULT_STREAM_INTERVAL,
        "duration",
        "while 8 or more requests decode, each stream sends what it has at most this often, several tokens a "
        "message (fewer messages to relay at high concurrency); fewer requests get every token at once; 0 = off",
    )
    stall_after: float = setting(
        DEFAULT_STALL_AFTER,
        "duration",
        "health turns NOT_SERVING when the MLX thread makes no progress this long; prefill "
        "chunks are sized to take a quarter of it at most",
    )
    grace: float = setting(
        DEFAULT_GRACE,
        "duration",
        "seconds in-flight work gets after SIGTERM (the supervisor's drain_grace)",
        config=False,
    )
    adapters: str = setting(
        "",
        "adapters",
        "LoRA adapters over the target, chosen per request (model NAME:ADAPTER): in the config a table "
        '{name = "folder or org/repo"}; on the command line name=folder,name=folder (runner/loading/adapters.py)',
    )
    reasoning_format: str = setting(
        "auto",
        "str",
        'how the model\'s reasoning is kept apart from its answer: "auto" (recognised from the chat template), '
        '"think" (<think> blocks), "harmony" (gpt-oss\'s channels) or "none" (its reasoning is part of the answer)',
    )
    tool_format: str = setting(
        "",
        "str",
        'how the model writes tool calls: "hermes", "llama3", "mistral", "pythonic" or "generic" (tools '
        "described in a system message, answers held to JSON); default: recognised from the chat template",
    )
    max_images: int = setting(8, "int", "images one request may hold at most (a model that sees: issue #39)")
    max_image_bytes: int = setting(5 * 2**20, "int", "the most bytes one image may have, encoded (PNG, JPEG, ...)")
    max_image_pixels: int = setting(
        25_000_000, "int", "the most pixels (width x height) one image may have, read from its header before decoding"
    )
    image_pixels: int = setting(
        1024 * 1024,
        "int",
        "the most pixels of an image the model sees: a larger one is scaled down, its aspect kept, before the "
        "model's processor (which may scale it further). Bounds the vision tower's memory, which the estimate counts",
    )
    image_urls: str = setting(
        "off",
        "str",
        'http(s) image URLs: "off" (refused: send images as data) or "public" (fetched from public addresses only, '
        "no redirects, max_image_bytes, 10 s)",
    )
    image_url_hosts: str = setting(
        "",
        "str",
        "hosts whose image URLs are fetched even at a private address (an internal image server), comma-separated",
    )
    kind: str = setting(
        "auto",
        "str",
        'what the model does: "generate", "embed" (embeddings) or "rerank" (a cross-encoder); "auto" tells it '
        "from the folder (common/embedding.py: modules.json, the config's architectures)",
    )
    matryoshka: str = setting(
        "",
        "ints",
        "an embedding model trained for shorter vectors (Matryoshka): the sizes a request's dimensions may ask, "
        "e.g. [512, 256, 128]; empty = its full vectors only",
    )
    embed_batch: int = setting(
        64, "int", "an embedding or reranking model's inputs in one forward pass at most (runner/embedding)"
    )
    debug_rpcs: bool = setting(False, "bool", "debug: enable the DebugBlock RPC")

    def __post_init__(self):
        for f in dataclasses.fields(self):  # each value in its one form (a Path, seconds as a float, ...)
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _PARSERS[f.metadata["kind"]](f.name, value))
        self.validate()

    # -- checks -----------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Every setting's range and how they go together; raises SettingsError naming the key."""
        if self.drafter not in ("",) + DRAFTERS:
            raise SettingsError("drafter", f"{self.drafter!r} is not one of {', '.join(DRAFTERS)}")
        if self.drafter == "model" and self.draft is None:
            raise SettingsError("drafter", '"model" needs a draft')
        if self.drafter == "head" and self.head is None:
            raise SettingsError("drafter", '"head" needs head (the drafter head\'s folder)')
        if self.head is not None:
            from .heads import problem

            if why := problem(self.head, self.target):
                raise SettingsError("head", why)
        if self.drafter == "block" and self.block is None:
            raise SettingsError("drafter", '"block" needs block (the block drafter\'s folder)')
        if not 1 <= self.max_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            raise SettingsError("max_draft_tokens", f"must lie in [1, {MAX_NUM_DRAFT_TOKENS}]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SettingsError("ngram_min", "must be at least 1 and at most ngram_max")
        if self.release_interval <= 0:
            raise SettingsError("release_interval", "must be positive")
        if not 1 <= self.ranks <= MAX_RANKS:
            raise SettingsError("ranks", f"must lie in [1, {MAX_RANKS}]")
        if self.parallelism not in PARALLELISMS:
            raise SettingsError("parallelism", f"{self.parallelism!r} is not one of {', '.join(PARALLELISMS)}")
        if self.backend not in BACKENDS:
            why = BACKENDS_NOT_WIRED.get(self.backend, "")
            raise SettingsError("backend", f"{self.backend!r} is not one of {', '.join(BACKENDS)}{why}")
        if self.backend == "nccl" and self.parallelism == "pipeline":
            raise SettingsError("parallelism", "MLX's nccl backend has no send/recv, which a pipeline needs")
        if self.hostfile is not None:
            hosts = read_hostfile(self.hostfile)
            if len(hosts) != self.ranks:
                raise SettingsError("hostfile", f"{self.hostfile} names {len(hosts)} ranks; ranks is {self.ranks}")
        if self.ranks > 1 and self.adapters:
            raise SettingsError("adapters", "a runner group serves no LoRA adapters yet: leave ranks at 1")
        if self.ranks > 1 and self.prompt_cache_dir is not None:
            raise SettingsError("ranks", "a group keeps no disk tier yet: leave prompt_cache_dir unset")
        if self.ranks > 1 and self.prompt_cache_cold_after:
            raise SettingsError("ranks", "a group has no cold tier yet: leave prompt_cache_cold_after at 0")
        if self.kv_bits not in (0, *KV_BITS):
            raise SettingsError("kv_bits", f"must be 0 (float), {' or '.join(map(str, KV_BITS))}")
        if self.kv_group_size not in KV_GROUP_SIZES:
            raise SettingsError("kv_group_size", f"must be one of {', '.join(map(str, KV_GROUP_SIZES))}")
        if self.quantized_kv_start < 0:
            raise SettingsError("quantized_kv_start", "must not be negative")
        if self.dtype not in DTYPES:
            raise SettingsError("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.max_context < 0 or self.max_context == 1:
            raise SettingsError("max_context", "must be at least 2 (0 = the model's own)")
        if self.max_output_tokens < 0:
            raise SettingsError("max_output_tokens", "must be >= 0 (0 = no cap)")
        if self.batch_memory is not None and self.batch_memory <= 0:
            raise SettingsError("batch_memory", "must be positive")
        if self.max_queue < 0:
            raise SettingsError("max_queue", "must be >= 0")
        if self.max_pending_rounds < 1:
            raise SettingsError("max_pending_rounds", "must be >= 1")
        if not 0 <= self.stream_interval <= 1:
            raise SettingsError("stream_interval", "must be between 0 and 1 second")
        if self.max_batch < 1:
            raise SettingsError("max_batch", "must be at least 1")
        if self.stall_after <= 0:
            raise SettingsError("stall_after", "must be positive")
        if self.reasoning_format not in ("auto", "none", *REASONING_FORMATS):
            raise SettingsError(
                "reasoning_format",
                f"{self.reasoning_format!r} is not one of auto, none, {', '.join(REASONING_FORMATS)}",
            )
        if self.image_urls not in ("off", "public"):
            raise SettingsError("image_urls", f"{self.image_urls!r} is not one of off, public")
        for name in ("max_images", "max_image_bytes", "max_image_pixels", "image_pixels"):
            if getattr(self, name) < 1:
                raise SettingsError(name, "must be at least 1")
        if self.kind not in ("auto", "generate", "embed", "rerank"):
            raise SettingsError("kind", f"{self.kind!r} is not one of auto, generate, embed, rerank")
        if self.embed_batch < 1:
            raise SettingsError("embed_batch", "must be at least 1")
        if self.tool_format and self.tool_format not in TOOL_FORMATS:
            raise SettingsError("tool_format", f"{self.tool_format!r} is not one of {', '.join(TOOL_FORMATS)}")

    # -- what the engine reads --------------------------------------------------------------------------

    @property
    def matryoshka_dimensions(self) -> tuple[int, ...]:
        return tuple(int(n) for n in self.matryoshka.split(",") if n)

    @property
    def prefill_seconds(self) -> float:
        """A prefill chunk should take about this long, at most: a quarter of the stall time."""
        return self.stall_after / 4

    def prefill_chunk_on(self, device: str) -> int:
        """The most prompt tokens one forward pass takes on ``device`` ("cpu" or a GPU's)."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        return CPU_PREFILL_CHUNK if device == "cpu" else DEFAULT_PREFILL_CHUNK

    @property
    def prefill_score_bytes(self) -> int:
        """CPU attention's transient score matrix, at most (``runner.prefill``)."""
        return DEFAULT_PREFILL_SCORE_BYTES

    # -- the config file --------------------------------------------------------------------------------

    @classmethod
    def config_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.metadata["config"]]

    @classmethod
    def from_table(cls, table: dict, **given) -> RunnerSettings:
        """Read the keys of ``table`` that are settings (a model's config table; each value is parsed and checked
        once, by ``__post_init__``); ``table`` keeps the rest. ``given``: settings the caller sets itself (the
        name; the supervisor sets the grace at each start)."""
        return cls(**given, **{key: table.pop(key) for key in cls.config_keys() if key in table})

    # -- the runner's command line ----------------------------------------------------------------------

    def to_argv(self) -> list[str]:
        """``--key-with-dashes VALUE`` for every setting that is not its default (booleans ``--key`` or
        ``--no-key``); ``add_arguments`` and ``from_namespace`` read it back into an equal object."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = _flag(f.name)
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + flag[2:])
            else:
                argv += [flag, "auto" if value is None else str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("settings (also the keys of a model's table in the supervisor's config)")
        for f in dataclasses.fields(cls):
            flag = _flag(f.name)
            default = "auto" if f.metadata["kind"] in ("depth", "chunk") else f.default
            if f.metadata["kind"] == "bool":
                group.add_argument(
                    flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"]
                )
            else:
                group.add_argument(
                    flag,
                    dest=f.name,
                    default=None,
                    metavar=f.metadata["kind"].upper(),
                    help=f"{f.metadata['help']} (default: {default})",
                )

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> RunnerSettings:
        """The settings ``add_arguments`` parsed; a SettingsError names the flag."""
        values = {}
        for f in dataclasses.fields(cls):
            value = getattr(namespace, f.name)
            if value is None:
                continue
            convert = _FROM_TEXT.get(f.metadata["kind"])
            if convert is not None and isinstance(value, str):
                try:
                    value = convert(value)
                except ValueError:
                    raise SettingsError(_flag(f.name), f"{value!r} is not a valid {f.metadata['kind']}") from None
            values[f.name] = value
        try:
            return cls(**values)
        except SettingsError as error:
            raise SettingsError(_flag(error.key), error.message) from None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
