"""The supervisor's configuration: a TOML file, or the zero-config default pair.

    listen = "127.0.0.1:50051"        # or "unix:///path"; non-loopback needs allow_remote
    http_listen = "127.0.0.1:8080"    # the HTTP APIs (OpenAI's, Anthropic's, Ollama's; "" = off); loopback, token, TLS
    ollama_listen = "127.0.0.1:11434" # the same APIs where Ollama's clients look ("" = off, the default)
    probe_port = 9464                 # HTTP /healthz /readyz /metrics on probe_host (0 = off)
    probe_host = "127.0.0.1"          # "0.0.0.0" in a pod, for the kubelet and Prometheus (needs allow_remote)
    runtime_dir = "/run/mlxserve"     # runner sockets (default: a private folder under /tmp)
    max_loaded = 2                    # runners alive at once; least recently used idle one is evicted
    gguf_cache_dir = "/var/cache/mlxserve/gguf"  # where .gguf targets are imported (default: ~/.cache/mlxserve/gguf)
    kernel_cache_dir = "/var/cache/mlxserve/kernels"  # MLX's compiled GPU kernels (default: ~/.cache/mlxserve/kernels)
    log_format = "text"               # or "json": one object per record, a runner's with its model and pid
    web_page = true                   # the web page on http_listen's / (docs/web.md); false = the APIs alone

    [models.default]
    target = "models/default/target"  # an mlx-lm folder, or a .gguf file (imported once at start-up:
                                      # supervisor/gguf_cache.py)
    draft = "models/default/draft"    # optional; a folder or a .gguf file too
    drafter = "model"                 # "model" (the draft), "ngram" (prompt lookup) or "none"; default: model
                                      # when a draft is given, else ngram
    num_draft_tokens = "auto"         # "auto": the depth is chosen round by round; a number pins it
    max_draft_tokens = 6              # the deepest round "auto" tries
    ngram_max = 4                     # prompt lookup matches the context's last 4..2 tokens
    ngram_min = 2
    release_interval = 256
    cache_limit = "default"           # "default", "unbounded" or bytes
    sampling = {temperature = 0.7}    # what a request that leaves a sampling field out gets (else the API's default)
    soft_limit = "2GiB"               # ReleaseMemory above this RSS (anonymous)
    hard_limit = "4GiB"               # drain and restart above this
    keep_alive = "5m"                 # unload after this long idle ("0" = never)
    load_at_start = true
    dtype = "auto"                    # "auto", "checkpoint" (as stored, quantized stays quantized) or "float32"
    max_context = 4096                # lower the model's context length (default: the model's own)
    max_batch = 16                    # requests decoded together (1 = one at a time)
    max_queue = 512                   # requests that may wait for a place in the batch; the next is refused
    stall_after = "30s"               # no progress of the MLX thread this long = hung
    tool_format = "hermes"            # how it writes tool calls; default: recognised from its chat template
    prompt_cache = "1GiB"             # KV caches kept for prefix reuse; 0 = off; default: see supervisor/memory.py
    batch_memory = "2GiB"             # batched requests' caches, projected to their ends; default: derived

A model's runner settings (every key above but sampling, soft_limit, hard_limit, keep_alive and load_at_start) are
read, checked and defaulted in one place, ``common.settings.RunnerSettings``; the full list of keys is
docs/configuration.md. Every problem is reported as one ConfigError naming the key. Reading the config imports
nothing: a .gguf file becomes a folder at start-up (``resolve_gguf``).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from common.defaults import DEFAULT_DRAFT, DEFAULT_GRACE, DEFAULT_TARGET, SMOLLM2_DIR
from common.logs import LOG_FORMATS
from common.settings import RunnerSettings, SettingsError, adapter_folders, check_type
from common.settings import parse_duration as _duration
from common.settings import parse_size as _size

from .gguf_cache import GGUFCacheError, default_cache_dir, imported_folder
from .hub import parse_ref

DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_HTTP_LISTEN = "127.0.0.1:8080"
DEFAULT_PROBE_PORT = 9464
PULL = ("never", "cached", "any")


class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"config: {key}: {message}")
        self.key = key


@dataclass(frozen=True)
class ModelConfig:
    """One model: its runner's settings, and what the supervisor itself does with it."""

    name: str
    runner: RunnerSettings
    soft_limit: int = 0  # bytes of anonymous memory; 0 = none
    hard_limit: int = 0
    keep_alive: float = 0.0  # seconds idle before unloading; 0 = never
    load_at_start: bool = True
    # What a request that leaves a sampling field out gets, in every API (``SAMPLING``; else the API's default).
    sampling: dict = field(default_factory=dict)
    # target / draft named as hub references (supervisor.hub): resolved into the hub cache at start-up
    # (``resolve_hub``), when the runner's paths become the cached folders or files.
    refs: dict = field(default_factory=dict)

    @property
    def target(self) -> Path:
        return self.runner.target

    @property
    def draft(self) -> Path | None:
        return self.runner.draft


@dataclass(frozen=True)
class SupervisorConfig:
    models: dict[str, ModelConfig]
    listen: str = DEFAULT_LISTEN
    http_listen: str = DEFAULT_HTTP_LISTEN
    ollama_listen: str = ""  # a second address for the HTTP APIs, where Ollama's clients look ("" = off)
    probe_port: int = DEFAULT_PROBE_PORT
    probe_host: str = "127.0.0.1"
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
    gguf_cache_dir: Path = field(default_factory=lambda: default_cache_dir())
    # MLX's CUDA backend compiles kernels on first use (seconds each) and keeps them in MLX_PTX_CACHE_DIR:
    # runners get this folder, so a restart finds them compiled (docs/gpu.md).
    kernel_cache_dir: Path = field(default_factory=lambda: default_cache_dir("kernels"))
    log_format: str = "text"
    web_page: bool = True  # the page at the HTTP API's / (supervisor/web_ui.py, docs/web.md)
    # Whether a request may name a hub repository that is not in the config (supervisor.hub): "never", "cached"
    # (one already in the hub cache is loaded with the default settings) or "any" (also pulled; and the APIs'
    # pulls are allowed).
    pull: str = "cached"

    @property
    def loaded_cap(self) -> int:
        return self.max_loaded or len(self.models)


# What a unix socket's path may hold: sun_path's 108 bytes on Linux (104 on macOS) less the terminating NUL.
SOCKET_PATH_MAX = 103 if sys.platform == "darwin" else 107
SOCKET_DIGEST = 12  # hex digits of a model name's digest, the shortest socket file name (plus ".sock")


def socket_path(runtime_dir: Path, name: str) -> Path:
    """Where the runner of model ``name`` listens: ``runtime_dir/NAME.sock``. A configured name that is a file
    name stays as it is; a hub repository's (``org/name@rev``) has what a file name cannot hold replaced and a
    digest added where that could make two names one. Where the path would be longer than a unix socket's may be
    (a deep runtime_dir, a long name), the file is the name's digest alone: ``from_dict`` refused a runtime_dir
    too deep for even that."""
    digest = hashlib.sha256(name.encode()).hexdigest()[:SOCKET_DIGEST]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    path = runtime_dir / (f"{name}.sock" if safe == name and len(name) <= 64 else f"{safe[:40]}-{digest}.sock")
    return path if len(os.fsencode(path)) <= SOCKET_PATH_MAX else runtime_dir / f"{digest}.sock"


def default_runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"mlxserve-{os.getuid()}"


def parse_size(key: str, value) -> int:
    try:
        return _size(key, value)
    except SettingsError as error:
        raise ConfigError(key, error.message) from None


def parse_duration(key: str, value) -> float:
    try:
        return _duration(key, value)
    except SettingsError as error:
        raise ConfigError(key, error.message) from None


def _take(table: dict, key: str, prefix: str, kind, default):
    if key not in table:
        return default
    try:
        return check_type(f"{prefix}{key}", table.pop(key), kind)
    except SettingsError as error:
        raise ConfigError(error.key, error.message) from None


def _folder(key: str, path: Path) -> Path:
    if not path.is_dir():
        raise ConfigError(key, f"no such folder: {path}")
    if not (path / "config.json").is_file():
        raise ConfigError(key, f"{path} holds no config.json (not an mlx-lm model folder)")
    return path


def _model_path(key: str, value, base: Path) -> Path | None:
    """A model folder, or a .gguf file (imported at start-up, ``resolve_gguf``), relative to the config's folder."""
    if value is None:
        return None
    path = value if value.is_absolute() else base / value
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(key, f"no such file: {path}")
        return path
    return _folder(key, path)


def _cache_dir(key: str, value: Path | None, base: Path) -> Path | None:
    """A folder the runner writes to (``~`` expanded, relative to the config's folder); made when missing, and
    refused at load when it cannot be."""
    if value is None:
        return None
    path = value.expanduser()
    path = path if path.is_absolute() else base / path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(key, f"cannot make {path}: {error.strerror}") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(key, f"{path} is not writable")
    return path


# A model's sampling defaults: each field's check, as common.requests.check_fields judges a request's.
SAMPLING = {
    "temperature": (lambda v: 0 <= v <= 100, "a number >= 0"),
    "top_p": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: isinstance(v, int) and 0 <= v < 2**31, "an integer >= 0 (0 turns it off)"),
    "min_p": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
}


def _sampling(key: str, table) -> dict:
    """``[models.NAME.sampling]``: what a request that leaves temperature, top_p, top_k or min_p out gets, in
    every API, instead of that API's own default (OpenAI's and Anthropic's temperature 1, Ollama's 0.8, ...)."""
    if not isinstance(table, dict):
        raise ConfigError(key, "expected a table such as {temperature = 0.7, top_p = 0.8}")
    for name, value in table.items():
        if name not in SAMPLING:
            raise ConfigError(f"{key}.{name}", f"unknown key (one of {', '.join(SAMPLING)})")
        check, wanted = SAMPLING[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not check(value):
            raise ConfigError(f"{key}.{name}", f"must be {wanted}")
    return dict(table)


def _model(name: str, table: dict, base: Path) -> ModelConfig:
    p = f"models.{name}."
    if not isinstance(table, dict):
        raise ConfigError(f"models.{name}", "expected a table")
    table = dict(table)
    if "target" not in table:
        raise ConfigError(f"{p}target", "is required")
    refs = {}
    for key in ("target", "draft"):  # a hub reference where no such path exists here
        value = table.get(key)
        ref = parse_ref(value) if isinstance(value, str) else None
        if ref is not None and not (base / Path(value).expanduser()).exists():
            refs[key] = ref
    if isinstance(table.get("adapters"), dict):  # each a folder (relative to the config's) or a hub reference
        adapters = {}
        for adapter, value in table["adapters"].items():
            path = base / Path(value).expanduser() if isinstance(value, str) else None
            ref = parse_ref(value) if isinstance(value, str) else None
            if path is not None and path.exists():
                if not (path / "adapter_config.json").is_file():
                    raise ConfigError(f"{p}adapters.{adapter}", f"{path} holds no adapter_config.json")
                value = str(path.resolve())
            elif ref is not None:
                refs[f"adapters.{adapter}"] = ref
            elif isinstance(value, str):
                raise ConfigError(f"{p}adapters.{adapter}", f"no such folder: {path} (nor a hub repository)")
            adapters[adapter] = value
        table["adapters"] = adapters
    if isinstance(table.get("head"), str):  # a drafter head's folder (runner.drafting.head), relative to the config's
        head = Path(table["head"]).expanduser()
        table["head"] = str(head if head.is_absolute() else base / head)
    # a block drafter's folder (runner.drafting.block), relative to the config's
    if isinstance(table.get("block"), str):
        block = Path(table["block"]).expanduser()
        table["block"] = str(block if block.is_absolute() else base / block)
    if isinstance(table.get("hostfile"), str):  # relative to the config's folder, like the model paths
        hostfile = Path(table["hostfile"]).expanduser()
        table["hostfile"] = str(hostfile if hostfile.is_absolute() else base / hostfile)
    try:
        settings = RunnerSettings.from_table(table, name=name)  # the grace is the supervisor's at each start
    except SettingsError as error:
        raise ConfigError(f"{p}{error.key}", error.message) from None
    settings = replace(
        settings,
        target=settings.target if "target" in refs else _model_path(f"{p}target", settings.target, base),
        draft=settings.draft if "draft" in refs else _model_path(f"{p}draft", settings.draft, base),
        head=_folder(f"{p}head", settings.head) if settings.head is not None else None,
        block=_folder(f"{p}block", settings.block) if settings.block is not None else None,
        prompt_cache_dir=_cache_dir(f"{p}prompt_cache_dir", settings.prompt_cache_dir, base),
    )
    soft = parse_size(f"{p}soft_limit", table.pop("soft_limit", 0))
    hard = parse_size(f"{p}hard_limit", table.pop("hard_limit", 0))
    if soft and hard and soft >= hard:
        raise ConfigError(f"{p}soft_limit", "must be below hard_limit")
    model = ModelConfig(
        name=name,
        runner=settings,
        soft_limit=soft,
        hard_limit=hard,
        keep_alive=parse_duration(f"{p}keep_alive", table.pop("keep_alive", 0)),
        load_at_start=_take(table, "load_at_start", p, bool, True),
        sampling=_sampling(f"{p}sampling", table.pop("sampling", {})),
        refs=refs,
    )
    if table:
        raise ConfigError(f"{p}{sorted(table)[0]}", "unknown key")
    return model


def resolve_hub(config: SupervisorConfig) -> SupervisorConfig:
    """The config with every hub reference of a target or draft replaced by its path in the hub cache, pulled
    first where it is not there (``supervisor.hub.pull``; the cache only under HF_HUB_OFFLINE). Done at start-up;
    a reference that cannot be served is a ConfigError naming the model's key and why."""
    from . import hub

    models = {}
    for name, model in config.models.items():
        paths = {}
        for key, ref in model.refs.items():
            try:
                try:
                    paths[key] = hub.cached(ref)
                except hub.HubError:
                    paths[key] = hub.pull(ref, hub.LoggedProgress(str(ref)))
            except hub.HubError as error:
                raise ConfigError(f"models.{name}.{key}", error.message) from None
        adapters = adapter_folders(model.runner.adapters)
        for key in [k for k in paths if k.startswith("adapters.")]:  # an adapter's repository: its folder
            adapters[key.removeprefix("adapters.")] = str(paths.pop(key))
        if adapters:
            paths["adapters"] = ",".join(f"{adapter}={folder}" for adapter, folder in adapters.items())
        models[name] = replace(model, runner=replace(model.runner, **paths)) if paths else model
    return replace(config, models=models)


def resolve_gguf(config: SupervisorConfig) -> SupervisorConfig:
    """The config with every .gguf target or draft replaced by the folder it is imported into (once, in a child
    process: ``supervisor.gguf_cache``). Done at start-up, not while the config is read; a file the importer
    refuses is a ConfigError naming the model's key."""
    models = {}
    for name, model in config.models.items():
        paths = {}
        for key in ("target", "draft"):
            path = getattr(model.runner, key)
            if path is not None and path.suffix.lower() == ".gguf":
                try:
                    paths[key] = imported_folder(path, config.gguf_cache_dir)
                except GGUFCacheError as error:
                    raise ConfigError(f"models.{name}.{key}", str(error)) from None
        models[name] = replace(model, runner=replace(model.runner, **paths)) if paths else model
    return replace(config, models=models)


def is_loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def _http_address(key: str, address: str, allow_remote: bool) -> str:
    """An HTTP listen address (HOST:PORT, or "" for off), checked."""
    if address:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ConfigError(key, f"{address!r} is not HOST:PORT")
        if not is_loopback(address) and not allow_remote:
            raise ConfigError(key, f"{address} is not a loopback address: set allow_remote = true to bind it")
    return address


def from_dict(data: dict, base: Path) -> SupervisorConfig:
    data = dict(data)
    models_table = data.pop("models", None)
    if not isinstance(models_table, dict) or not models_table:
        raise ConfigError("models", "at least one [models.NAME] table is required")
    gguf_cache_dir = _take(data, "gguf_cache_dir", "", str, "")
    gguf_cache_dir = (base / gguf_cache_dir) if gguf_cache_dir else default_cache_dir()
    kernel_cache_dir = _take(data, "kernel_cache_dir", "", str, "")
    kernel_cache_dir = (base / kernel_cache_dir) if kernel_cache_dir else default_cache_dir("kernels")
    log_format = _take(data, "log_format", "", str, "text")
    if log_format not in LOG_FORMATS:
        raise ConfigError("log_format", f"{log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    pull = _take(data, "pull", "", str, "cached")
    if pull not in PULL:
        raise ConfigError("pull", f"{pull!r} is not one of {', '.join(PULL)}")
    models = {}
    for name, table in models_table.items():
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
            raise ConfigError(f"models.{name}", "names are letters, digits, '.', '_' and '-'")
        models[name] = _model(name, table, base)
    listen = _take(data, "listen", "", str, DEFAULT_LISTEN)
    allow_remote = _take(data, "allow_remote", "", bool, False)
    if not is_loopback(listen) and not allow_remote:
        raise ConfigError("listen", f"{listen} is not a loopback address: set allow_remote = true to bind it")
    http_listen = _http_address("http_listen", _take(data, "http_listen", "", str, DEFAULT_HTTP_LISTEN), allow_remote)
    ollama_listen = _http_address("ollama_listen", _take(data, "ollama_listen", "", str, ""), allow_remote)
    if ollama_listen and ollama_listen == http_listen:
        raise ConfigError("ollama_listen", "must differ from http_listen (which serves Ollama's API already)")
    probe_port = _take(data, "probe_port", "", int, DEFAULT_PROBE_PORT)
    if not 0 <= probe_port <= 65535:
        raise ConfigError("probe_port", "must lie in [0, 65535]")
    probe_host = _take(data, "probe_host", "", str, "127.0.0.1")
    if not is_loopback(f"{probe_host}:0") and not allow_remote:
        raise ConfigError("probe_host", f"{probe_host} is not a loopback address: set allow_remote = true to bind it")
    runtime_dir = Path(_take(data, "runtime_dir", "", str, str(default_runtime_dir())))
    room = SOCKET_PATH_MAX - len(f"/{'0' * SOCKET_DIGEST}.sock")  # what the shortest socket path leaves the folder
    if len(os.fsencode(runtime_dir)) > room:
        raise ConfigError("runtime_dir", f"{runtime_dir} is too long for the runners' sockets (at most {room} bytes)")
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
    for key in (
        "startup_timeout",
        "health_period",
        "health_deadline",
        "memory_period",
        "restart_backoff",
        "restart_backoff_cap",
        "stable_after",
        "drain_grace",
        "kill_timeout",
    ):
        if key in data:
            timings[key] = parse_duration(key, data.pop(key))
    for key in ("health_misses", "max_restarts"):
        if key in data:
            timings[key] = _take(data, key, "", int, 0)
            if timings[key] < 1:
                raise ConfigError(key, "must be at least 1")
    config = SupervisorConfig(
        models=models,
        listen=listen,
        http_listen=http_listen,
        ollama_listen=ollama_listen,
        probe_port=probe_port,
        probe_host=probe_host,
        runtime_dir=runtime_dir,
        max_loaded=max_loaded,
        allow_remote=allow_remote,
        auth_token=_take(data, "auth_token", "", str, ""),
        tls_cert=base / tls_cert if tls_cert else None,
        tls_key=base / tls_key if tls_key else None,
        gguf_cache_dir=gguf_cache_dir,
        kernel_cache_dir=kernel_cache_dir,
        log_format=log_format,
        pull=pull,
        web_page=_take(data, "web_page", "", bool, True),
        **timings,
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
    models = {"default": ModelConfig("default", RunnerSettings(target=DEFAULT_TARGET, draft=DEFAULT_DRAFT))}
    if (SMOLLM2_DIR / "config.json").is_file():
        models["smollm2"] = ModelConfig(
            "smollm2", RunnerSettings(target=SMOLLM2_DIR, name="smollm2"), load_at_start=False
        )
    return SupervisorConfig(models=models, **overrides)


def config_keys() -> list[str]:
    """Every key the config file takes: top-level ones by name, a model's as ``models.NAME.key``."""
    top = [f.name for f in fields(SupervisorConfig) if f.name not in ("models", "tls_cert", "tls_key")]
    top += ["tls_cert", "tls_key"]
    model = RunnerSettings.config_keys() + [
        f.name for f in fields(ModelConfig) if f.name not in ("name", "runner", "refs")
    ]
    return top + [f"models.NAME.{key}" for key in model]
