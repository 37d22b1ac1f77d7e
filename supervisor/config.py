"""The supervisor's configuration: a TOML file, or the zero-config default pair.

    listen = "127.0.0.1:50051"        # or "unix:///path"; non-loopback needs allow_remote
    http_listen = "127.0.0.1:8080"    # the OpenAI-compatible HTTP API ("" = off); same loopback, token and TLS rules
    probe_port = 9464                 # HTTP /healthz /readyz /metrics on 127.0.0.1 (0 = off)
    runtime_dir = "/run/mlxserve"     # runner sockets (default: a private folder under /tmp)
    max_loaded = 2                    # runners alive at once; least recently used idle one is evicted
    gguf_cache_dir = "/var/cache/mlxserve/gguf"  # where .gguf targets are imported (default: ~/.cache/mlxserve/gguf)

    [models.default]
    target = "models/default/target"  # an mlx-lm folder, or a .gguf file (imported once: supervisor/gguf_cache.py)
    draft = "models/default/draft"    # optional; a folder or a .gguf file too
    drafter = "model"                 # "model" (the draft), "ngram" (prompt lookup) or "none"; default: model
                                      # when a draft is given, else ngram
    num_draft_tokens = "auto"         # "auto": the depth is chosen round by round; a number pins it
    max_draft_tokens = 6              # the deepest round "auto" tries
    ngram_max = 4                     # prompt lookup matches the context's last 4..2 tokens
    ngram_min = 2
    release_interval = 256
    cache_limit = "default"           # "default", "unbounded" or bytes
    soft_limit = "2GiB"               # ReleaseMemory above this RSS (anonymous)
    hard_limit = "4GiB"               # drain and restart above this
    keep_alive = "5m"                 # unload after this long idle ("0" = never)
    load_at_start = true
    dtype = "auto"                    # "auto", "checkpoint" (as stored, quantized stays quantized) or "float32"
    max_context = 4096                # lower the model's context length (default: the model's own)
    max_batch = 16                    # requests decoded together (1 = one at a time)
    max_queue = 512                   # requests that may wait for a place in the batch; the next gets RESOURCE_EXHAUSTED
    stall_after = "30s"               # no progress of the MLX thread this long = hung
    prompt_cache = "1GiB"             # KV caches kept for prefix reuse; 0 = off; default: see supervisor/memory.py
    batch_memory = "2GiB"             # batched requests' caches, projected to their ends; default: see supervisor/memory.py

Every problem is reported as one ConfigError naming the key.
"""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from common.defaults import (DEFAULT_DRAFT, DEFAULT_DTYPE, DEFAULT_GRACE, DEFAULT_MAX_BATCH, DEFAULT_MAX_DRAFT_TOKENS,
                             DEFAULT_MAX_QUEUE,
                             DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN, DEFAULT_RELEASE_INTERVAL, DEFAULT_STALL_AFTER,
                             DEFAULT_TARGET, DTYPES, MAX_NUM_DRAFT_TOKENS, SMOLLM2_DIR)

from .gguf_cache import GGUFCacheError, default_cache_dir, imported_folder

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8080"
DEFAULT_PROBE_PORT = 9464


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"config: {key}: {message}")
        self.key = key


@dataclass(frozen=True)
class ModelConfig:
    name: str
    target: Path
    draft: Path | None = None
    num_draft_tokens: int | None = None  # None = adaptive
    max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS
    drafter: str = ""  # "" = model when a draft is configured, else ngram
    ngram_max: int = DEFAULT_NGRAM_MAX
    ngram_min: int = DEFAULT_NGRAM_MIN
    release_interval: int = DEFAULT_RELEASE_INTERVAL
    cache_limit: str | int = "default"
    soft_limit: int = 0  # bytes of anonymous memory; 0 = none
    hard_limit: int = 0
    keep_alive: float = 0.0  # seconds idle before unloading; 0 = never
    load_at_start: bool = True
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    release_enabled: bool = True  # debug: False starts the runner with --no-release
    debug_rpcs: bool = False
    stall_after: float = DEFAULT_STALL_AFTER  # the runner reports NOT_SERVING when its MLX thread is stuck this long
    dtype: str = DEFAULT_DTYPE
    max_context: int = 0  # 0 = the model's own context length
    prompt_cache: int | None = None  # bytes; None = derived (supervisor.memory.prompt_cache_budget); 0 = off
    batch_memory: int | None = None  # bytes; None = derived (supervisor.memory.batch_memory_budget)


@dataclass(frozen=True)
class SupervisorConfig:
    models: dict[str, ModelConfig]
    listen: str = DEFAULT_LISTEN
    http_listen: str = DEFAULT_HTTP_LISTEN
    probe_port: int = DEFAULT_PROBE_PORT
    runtime_dir: Path = field(default_factory=lambda: default_runtime_dir())
    max_loaded: int = 0  # 0 = as many as there are models
    allow_remote: bool = False
    auth_token: str = ""
    tls_cert: Path | None = None
    tls_key: Path | None = None
    startup_timeout: float = 120.0
    health_period: float = 2.0
    health_deadline: float = 2.0
    health_misses: int = 3
    memory_period: float = 1.0
    restart_backoff: float = 1.0
    restart_backoff_cap: float = 30.0
    stable_after: float = 60.0
    max_restarts: int = 5
    drain_grace: float = DEFAULT_GRACE
    kill_timeout: float = 5.0

    @property
    def loaded_cap(self) -> int:
        return self.max_loaded or len(self.models)


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"mlxserve-{os.getuid()}"


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}


def parse_size(key: str, value) -> int:
    if isinstance(value, bool):
        raise ConfigError(key, "expected a size such as 512MiB or 2GB")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(key, "must not be negative")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ConfigError(key, f"{value!r} is not a size such as 512MiB or 2GB")
    unit = (match.group(2) or "").lower().removesuffix("b")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_duration(key: str, value) -> float:
    if isinstance(value, bool):
        raise ConfigError(key, "expected a duration such as 30s or 5m")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(key, "must not be negative")
        return float(value)
    match = _DURATION.match(str(value))
    if not match:
        raise ConfigError(key, f"{value!r} is not a duration such as 30s or 5m")
    return float(match.group(1)) * _SECONDS[match.group(2)]


def _take(table: dict, key: str, prefix: str, kind, default):
    if key not in table:
        return default
    value = table.pop(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{prefix}{key}", f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _folder(key: str, path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(key, f"no such folder: {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(key, f"{path} holds no config.json (not an mlx-lm model folder)")
    return path


def _model_path(key: str, value: str, base: Path, gguf_cache_dir: Path) -> Path:
    """A model folder, or the folder a .gguf file is imported into (``supervisor.gguf_cache``)."""
    path = Path(value)
    path = path if path.is_absolute() else base / path
    if path.suffix.lower() != ".gguf":
        return _folder(key, path)
    try:
        return imported_folder(path, gguf_cache_dir)
    except GGUFCacheError as error:
        raise ConfigError(key, str(error)) from None


def _model(name: str, table: dict, base: Path, gguf_cache_dir: Path) -> ModelConfig:
    p = f"models.{name}."
    if not isinstance(table, dict):
        raise ConfigError(f"models.{name}", "expected a table")
    table = dict(table)
    if "target" not in table:
        raise ConfigError(f"{p}target", "is required")
    target = _model_path(f"{p}target", _take(table, "target", p, str, ""), base, gguf_cache_dir)
    draft_value = _take(table, "draft", p, str, "")
    draft = _model_path(f"{p}draft", draft_value, base, gguf_cache_dir) if draft_value else None
    k = table.pop("num_draft_tokens", "auto")
    if k == "auto":
        k = None
    elif isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_NUM_DRAFT_TOKENS:
        raise ConfigError(f"{p}num_draft_tokens", f'must be "auto" or a number in [0, {MAX_NUM_DRAFT_TOKENS}]')
    max_k = _take(table, "max_draft_tokens", p, int, DEFAULT_MAX_DRAFT_TOKENS)
    if not 1 <= max_k <= MAX_NUM_DRAFT_TOKENS:
        raise ConfigError(f"{p}max_draft_tokens", f"must lie in [1, {MAX_NUM_DRAFT_TOKENS}]")
    drafter = _take(table, "drafter", p, str, "")
    if drafter not in ("", "model", "ngram", "none"):
        raise ConfigError(f"{p}drafter", f'{drafter!r} is not one of "model", "ngram", "none"')
    if drafter == "model" and draft is None:
        raise ConfigError(f"{p}drafter", '"model" needs a draft folder')
    ngram_max = _take(table, "ngram_max", p, int, DEFAULT_NGRAM_MAX)
    ngram_min = _take(table, "ngram_min", p, int, DEFAULT_NGRAM_MIN)
    if not 1 <= ngram_min <= ngram_max:
        raise ConfigError(f"{p}ngram_min", "must be at least 1 and at most ngram_max")
    interval = _take(table, "release_interval", p, int, DEFAULT_RELEASE_INTERVAL)
    if interval <= 0:
        raise ConfigError(f"{p}release_interval", "must be positive")
    cache_limit = table.pop("cache_limit", "default")
    if cache_limit not in ("default", "unbounded"):
        cache_limit = parse_size(f"{p}cache_limit", cache_limit)
    soft = parse_size(f"{p}soft_limit", table.pop("soft_limit", 0))
    hard = parse_size(f"{p}hard_limit", table.pop("hard_limit", 0))
    if soft and hard and soft >= hard:
        raise ConfigError(f"{p}soft_limit", "must be below hard_limit")
    keep_alive = parse_duration(f"{p}keep_alive", table.pop("keep_alive", 0))
    max_queue = _take(table, "max_queue", p, int, DEFAULT_MAX_QUEUE)
    if max_queue < 0:
        raise ConfigError(f"{p}max_queue", "must be >= 0")
    max_batch = _take(table, "max_batch", p, int, DEFAULT_MAX_BATCH)
    if max_batch < 1:
        raise ConfigError(f"{p}max_batch", "must be at least 1")
    dtype = _take(table, "dtype", p, str, DEFAULT_DTYPE)
    if dtype not in DTYPES:
        raise ConfigError(f"{p}dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
    max_context = _take(table, "max_context", p, int, 0)
    if max_context < 0 or max_context == 1:
        raise ConfigError(f"{p}max_context", "must be at least 2 (0 = the model's own)")
    prompt_cache = parse_size(f"{p}prompt_cache", table.pop("prompt_cache")) if "prompt_cache" in table else None
    batch_memory = parse_size(f"{p}batch_memory", table.pop("batch_memory")) if "batch_memory" in table else None
    if batch_memory is not None and batch_memory <= 0:
        raise ConfigError(f"{p}batch_memory", "must be positive")
    stall_after = parse_duration(f"{p}stall_after", table.pop("stall_after", DEFAULT_STALL_AFTER))
    if stall_after <= 0:
        raise ConfigError(f"{p}stall_after", "must be positive")
    model = ModelConfig(
        name=name, target=target, draft=draft, num_draft_tokens=k, release_interval=interval,
        max_draft_tokens=max_k, drafter=drafter, ngram_max=ngram_max, ngram_min=ngram_min,
        cache_limit=cache_limit, soft_limit=soft, hard_limit=hard, keep_alive=keep_alive,
        load_at_start=_take(table, "load_at_start", p, bool, True), max_queue=max_queue, max_batch=max_batch,
        release_enabled=_take(table, "release_enabled", p, bool, True),
        debug_rpcs=_take(table, "debug_rpcs", p, bool, False),
        stall_after=stall_after, dtype=dtype, max_context=max_context, prompt_cache=prompt_cache,
        batch_memory=batch_memory,
    )
    if table:
        raise ConfigError(f"{p}{sorted(table)[0]}", "unknown key")
    return model


def is_loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def from_dict(data: dict, base: Path) -> SupervisorConfig:
    data = dict(data)
    models_table = data.pop("models", None)
    if not isinstance(models_table, dict) or not models_table:
        raise ConfigError("models", "at least one [models.NAME] table is required")
    gguf_cache_dir = _take(data, "gguf_cache_dir", "", str, "")
    gguf_cache_dir = (base / gguf_cache_dir) if gguf_cache_dir else default_cache_dir()
    models = {}
    for name, table in models_table.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
            raise ConfigError(f"models.{name}", "names are letters, digits, '.', '_' and '-'")
        models[name] = _model(name, table, base, gguf_cache_dir)
    listen = _take(data, "listen", "", str, DEFAULT_LISTEN)
    allow_remote = _take(data, "allow_remote", "", bool, False)
    if not is_loopback(listen) and not allow_remote:
        raise ConfigError("listen", f"{listen} is not a loopback address: set allow_remote = true to bind it")
    http_listen = _take(data, "http_listen", "", str, DEFAULT_HTTP_LISTEN)
    if http_listen:
        host, _, port = http_listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError("http_listen", f"{http_listen!r} is not HOST:PORT")
        if not is_loopback(http_listen) and not allow_remote:
            raise ConfigError("http_listen", f"{http_listen} is not a loopback address: set allow_remote = true "
                                             "to bind it")
    probe_port = _take(data, "probe_port", "", int, DEFAULT_PROBE_PORT)
    if not 0 <= probe_port <= 65535:
        raise ConfigError("probe_port", "must lie in [0, 65535]")
    runtime_dir = Path(_take(data, "runtime_dir", "", str, str(default_runtime_dir())))
    max_loaded = _take(data, "max_loaded", "", int, 0)
    if max_loaded < 0:
        raise ConfigError("max_loaded", "must be >= 0 (0 = all models)")
    tls_cert = _take(data, "tls_cert", "", str, "")
    tls_key = _take(data, "tls_key", "", str, "")
    if bool(tls_cert) != bool(tls_key):
        raise ConfigError("tls_cert", "tls_cert and tls_key go together")
    for key, value in (("tls_cert", tls_cert), ("tls_key", tls_key)):
        if value and not (base / value).is_file():
            raise ConfigError(key, f"no such file: {base / value}")
    timings = {}
    for key in ("startup_timeout", "health_period", "health_deadline", "memory_period", "restart_backoff",
                "restart_backoff_cap", "stable_after", "drain_grace", "kill_timeout"):
        if key in data:
            timings[key] = parse_duration(key, data.pop(key))
    for key in ("health_misses", "max_restarts"):
        if key in data:
            timings[key] = _take(data, key, "", int, 0)
            if timings[key] < 1:
                raise ConfigError(key, "must be at least 1")
    config = SupervisorConfig(
        models=models, listen=listen, http_listen=http_listen, probe_port=probe_port, runtime_dir=runtime_dir, max_loaded=max_loaded,
        allow_remote=allow_remote, auth_token=_take(data, "auth_token", "", str, ""),
        tls_cert=base / tls_cert if tls_cert else None, tls_key=base / tls_key if tls_key else None, **timings,
    )
    if data:
        raise ConfigError(sorted(data)[0], "unknown key")
    return config


def load(path: str | Path) -> SupervisorConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("--config", f"no such file: {path}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError("--config", f"{path} is not valid TOML: {error}") from None
    return from_dict(data, path.resolve().parent)


def default_config(**overrides) -> SupervisorConfig:
    """Zero configuration: the embedded default pair, loaded at start, and SmolLM2-135M-Instruct
    when `make real-model` has imported it (loaded on its first request)."""
    models = {"default": ModelConfig(name="default", target=DEFAULT_TARGET, draft=DEFAULT_DRAFT)}
    if (SMOLLM2_DIR / "config.json").is_file():
        models["smollm2"] = ModelConfig(name="smollm2", target=SMOLLM2_DIR, load_at_start=False)
    return SupervisorConfig(models=models, **overrides)


def config_keys() -> list[str]:
    """Every key the config file takes: top-level ones by name, a model's as ``models.NAME.key``."""
    top = ["listen", "http_listen", "probe_port", "runtime_dir", "max_loaded", "allow_remote", "auth_token",
           "tls_cert", "tls_key", "gguf_cache_dir", "startup_timeout", "health_period", "health_deadline",
           "health_misses", "memory_period", "restart_backoff", "restart_backoff_cap", "stable_after",
           "max_restarts", "drain_grace", "kill_timeout"]
    model = ["target", "draft", "drafter", "num_draft_tokens", "max_draft_tokens", "ngram_max", "ngram_min",
             "release_interval", "cache_limit", "soft_limit", "hard_limit", "keep_alive", "load_at_start", "dtype",
             "max_context", "max_batch", "max_queue", "stall_after", "prompt_cache", "batch_memory",
             "release_enabled", "debug_rpcs"]
    return top + [f"models.NAME.{key}" for key in model]
