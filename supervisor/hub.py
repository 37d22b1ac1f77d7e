"""Models by name: references to the Hugging Face hub, found in its standard cache or pulled into it (issue #37).

A model may be named as a repository wherever a folder may be (``target``, ``draft``, the CLI, a request's
``model`` where the ``pull`` setting allows it):

    org/name              an mlx-lm repository (its safetensors, config and tokenizer files)
    org/name@revision     the same at a branch, tag or commit
    org/name:Q4_K_M       a GGUF repository: the file of that quantization (llama.cpp's -hf convention)
    org/name/file.gguf    a GGUF repository: that file

Everything goes through ``huggingface_hub`` into its standard cache, so ``HF_HOME`` / ``HF_HUB_CACHE`` are
honoured and a model that mlx-lm or LM Studio downloaded already is found, not fetched again; ``HF_HUB_OFFLINE=1``
serves from the cache only; ``HF_TOKEN`` opens gated and private repositories.

A pull (``pull``) fetches only what a runner needs, and checks before any weight comes: the architecture is one
this installation loads (mlx-lm's model types, or the GGUF importer's), the memory estimate (from the weights'
own headers, read with byte ranges) fits this machine, and the disk has room. Files are fetched eight at a time,
as ``snapshot_download`` does; an interrupted file resumes where it stopped (the client keeps it beside the blob
and asks for the rest); each weight file's sha256 is checked against the one the hub publishes, and a file that
differs is deleted and named. Two pulls of one repository at once in this process share one download
(``Pulls``). Progress goes to a callback as ``Progress`` records (Ollama's pull records are made from them).

MLX-free: the supervisor checks an architecture by the files of the installed mlx-lm, without importing it.
"""

from __future__ import annotations

import ast
import fnmatch
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.footprint import FootprintError, ModelFootprint, estimate, expected_device, resolve_dtype
from common.status import ServiceError

# What a runner needs from an mlx-lm repository besides its weights: config, tokenizer and template files.
SUPPORT_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "*.tiktoken",
    "processor_config.json",
    "preprocessor_config.json",
    "adapter_config.json",
)
WEIGHTS = ("*.safetensors",)
DEFAULT_QUANTS = ("Q4_K_M", "Q4_0", "Q8_0")  # the file a GGUF repository gives when no quantization is named
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")  # runner.gguf's importer
GGUF_HEADER_BYTES = 1 << 20  # read first for the architecture; more only if its key comes later
DISK_MARGIN = 256 * 2**20  # left free on the cache's disk after a pull
REPO = r"[A-Za-z0-9][\w.-]*/[\w.-]+"
REF = re.compile(rf"(?P<repo>{REPO})(?:@(?P<revision>[\w./-]+?))?(?::(?P<quant>[\w.-]+))?")
GGUF_FILE = re.compile(rf"(?P<repo>{REPO})(?:@(?P<revision>[\w.-]+))?/(?P<file>[^@:]+\.gguf)", re.IGNORECASE)


class HubError(ServiceError):
    """A reference that cannot be served or pulled, saying why, with the status each API answers with."""


def not_found(message: str) -> HubError:
    return HubError(grpc.StatusCode.NOT_FOUND, message, "model")


# -- references ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRef:
    repo: str
    revision: str | None = None
    quant: str | None = None  # a GGUF repository's quantization to take
    file: str | None = None  # a GGUF repository's file to take

    @property
    def gguf(self) -> bool:
        return bool(self.quant or self.file)

    def __str__(self) -> str:
        text = self.repo + (f"@{self.revision}" if self.revision else "")
        if self.file:
            return f"{text}/{self.file}"
        return text + (f":{self.quant}" if self.quant else "")


def parse_ref(text: str) -> ModelRef | None:
    """The reference ``text`` spells, or None where it is not one (a local path, a configured name)."""
    if not isinstance(text, str) or text.startswith((".", "/", "~")) or "\\" in text:
        return None
    match = GGUF_FILE.fullmatch(text)
    if match:
        return ModelRef(match.group("repo"), match.group("revision"), file=match.group("file"))
    match = REF.fullmatch(text)
    if match:
        return ModelRef(match.group("repo"), match.group("revision"), quant=match.group("quant"))
    return None


# -- the files a runner needs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    name: str
    size: int
    sha256: str | None  # the hub's LFS sha256 (weights); None for a small file kept in git


@dataclass
class Plan:
    """What a pull fetches: the small files first, then the weights, at one commit."""

    ref: ModelRef
    commit: str
    support: list[RemoteFile]
    weights: list[RemoteFile]

    @property
    def files(self) -> list[RemoteFile]:
        return self.support + self.weights

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


def _matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatch(name.rsplit("/", 1)[-1], pattern) for pattern in patterns) and "/" not in name


def choose_files(ref: ModelRef, files: list[RemoteFile]) -> tuple[list[RemoteFile], list[RemoteFile]]:
    """(support files, weight files) of a repository's listing for ``ref``: never the ``.bin``/``.pth`` twins of
    safetensors weights, nor every quantization of a GGUF repository."""
    ggufs = [f for f in files if f.name.lower().endswith(".gguf")]
    safetensors = [f for f in files if _matches(f.name, WEIGHTS)]
    if ref.file:
        chosen = [f for f in ggufs if f.name == ref.file]
        if not chosen:
            raise not_found(f"{ref.repo} has no file {ref.file} (its GGUF files: {_names(ggufs)})")
        return [], chosen
    if ref.quant or (ggufs and not safetensors):
        quants = (ref.quant,) if ref.quant else DEFAULT_QUANTS
        for quant in quants:
            pattern = re.compile(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", re.IGNORECASE)
            chosen = [f for f in ggufs if pattern.search(f.name.rsplit("/", 1)[-1].removesuffix(".gguf"))]
            if chosen:
                break
        else:
            if ref.quant:
                raise not_found(f"{ref.repo} has no GGUF file of quantization {ref.quant} (its files: {_names(ggufs)})")
            chosen = sorted(ggufs, key=lambda f: f.size)[:1]  # none of the usual ones: the smallest
        if len(chosen) > 1 or re.search(r"-\d{5}-of-\d{5}\.gguf$", chosen[0].name):
            raise HubError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{ref}: a GGUF split into several files ({_names(chosen)}) is not imported here; name one whole "
                "file (org/name/file.gguf)",
                "model",
            )
        return [], chosen
    if not safetensors:
        raise HubError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{ref.repo} holds no safetensors weights and no GGUF file: not a model this server loads",
            "model",
        )
    return [f for f in files if _matches(f.name, SUPPORT_FILES)], safetensors


def _names(files) -> str:
    return ", ".join(f.name for f in files) or "none"


# -- what this installation loads -------------------------------------------------------------------------------


def supported_model_types() -> tuple[set[str], dict[str, str]]:
    """mlx-lm's model types (its ``models`` modules) and its remapping of other names onto them, read from the
    installed package's files without importing it (the supervisor stays MLX-free)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return set(), {}
    package = Path(next(iter(spec.submodule_search_locations)))
    types = {p.stem for p in (package / "models").glob("*.py") if not p.stem.startswith("_")}
    remapping: dict[str, str] = {}
    try:
        tree = ast.parse((package / "utils.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "MODEL_REMAPPING" for t in node.targets):
                remapping = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        pass
    return types, remapping


def check_model_type(ref: ModelRef, config: dict) -> None:
    model_type = config.get("model_type")
    types, remapping = supported_model_types()
    if not isinstance(model_type, str) or remapping.get(model_type, model_type) not in types:
        raise HubError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{ref}: model type {model_type!r} is not one this installation's mlx-lm loads; nothing was fetched "
            "but its config",
            "model",
        )


def gguf_architecture(read: Callable[[int, int], bytes]) -> str:
    """``general.architecture`` of a GGUF file, from its metadata at its start; ``read(offset, size)`` gives its
    bytes (a range of the remote file)."""
    buffer = b""

    def take(offset: int, size: int) -> bytes:
        nonlocal buffer
        while len(buffer) < offset + size:
            more = read(len(buffer), max(GGUF_HEADER_BYTES, offset + size - len(buffer)))
            if not more:
                raise ValueError("the file ends inside its metadata")
            buffer += more
        return buffer[offset : offset + size]

    if take(0, 4) != b"GGUF":
        raise ValueError("not a GGUF file")
    (version,) = struct.unpack("<I", take(4, 4))
    if version < 2:
        raise ValueError(f"GGUF version {version} is too old")
    (count,) = struct.unpack("<Q", take(16, 8))
    offset = 24
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack("<Q", take(at, 8))
        return take(at + 8, length).decode("utf-8", "replace"), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == 8:
            return string(at)[1]
        if kind == 9:
            inner, length = struct.unpack("<IQ", take(at, 12))
            at += 12
            if inner in sizes:
                return at + sizes[inner] * length
            for _ in range(length):
                at = skip(inner, at)
            return at
        return at + sizes[kind]

    for _ in range(count):
        key, offset = string(offset)
        (kind,) = struct.unpack("<I", take(offset, 4))
        offset += 4
        if key == "general.architecture" and kind == 8:
            return string(offset)[0]
        offset = skip(kind, offset)
    raise ValueError("its metadata has no general.architecture")


# -- the hub -----------------------------------------------------------------------------------------------------


def _hub():
    import huggingface_hub

    return huggingface_hub


def offline() -> bool:
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def hub_error(ref: ModelRef, error: Exception) -> HubError:
    """A huggingface_hub error as one line naming the repository."""
    from huggingface_hub import errors

    if isinstance(error, errors.GatedRepoError):
        return HubError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{ref.repo} is gated: accept its terms on the hub with your account and set HF_TOKEN to a token of it",
            "model",
        )
    if isinstance(error, errors.RevisionNotFoundError):
        return not_found(f"{ref.repo} has no revision {ref.revision!r} on the hub")
    if isinstance(error, errors.RepositoryNotFoundError):
        return not_found(f"no model {ref.repo} on the hub (or it is private: set HF_TOKEN)")
    if isinstance(error, errors.EntryNotFoundError):
        return not_found(f"{ref}: {error}")
    if isinstance(error, errors.OfflineModeIsEnabled | errors.LocalEntryNotFoundError):
        return not_found(f"{ref} is not in the hub cache ({cache_dir()}) and the hub is offline (HF_HUB_OFFLINE)")
    return HubError(grpc.StatusCode.UNAVAILABLE, f"{ref}: the hub could not be reached: {error}", "model")


def plan(ref: ModelRef) -> Plan:
    """The files a pull of ``ref`` fetches, from the hub's listing (with each weight's sha256)."""
    hub = _hub()
    try:
        info = hub.HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except Exception as error:  # noqa: BLE001 - every hub error is one line naming the repository
        raise hub_error(ref, error) from None
    files = [
        RemoteFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs is not None else None)
        for s in info.siblings or ()
    ]
    support, weights = choose_files(ref, files)
    return Plan(ref, info.sha, support, weights)


def _read_range(ref: ModelRef, commit: str, name: str, offset: int, size: int) -> bytes:
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    headers = build_hf_headers()
    headers["Range"] = f"bytes={offset}-{offset + size - 1}"
    response = get_session().get(hf_hub_url(ref.repo, name, revision=commit), headers=headers, timeout=60)
    hf_raise_for_status(response)
    return response.content


def footprint_of(plan: Plan, folder: Path) -> ModelFootprint:
    """The model's footprint before its weights come: its config (fetched) and its weights' safetensors headers,
    read from the hub with byte ranges."""
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for weight in plan.weights:
        (length,) = struct.unpack("<Q", _read_range(plan.ref, plan.commit, weight.name, 0, 8))
        if length > 100 * 2**20:
            raise FootprintError(f"{weight.name}: implausible safetensors header of {length} bytes")
        header = json.loads(_read_range(plan.ref, plan.commit, weight.name, 8, length))
        header.pop("__metadata__", None)
        tensors.update(header)
    return ModelFootprint.from_parts(folder, config, tensors)


def footprint(ref: ModelRef) -> ModelFootprint:
    """What the memory estimate needs of ``ref``: read from the hub cache, or (not cached) from the hub before
    any weight comes: its config and its weights' headers."""
    try:
        path = cached(ref)
    except HubError:
        path = None
    if path is not None and path.is_dir():
        return ModelFootprint.of(path)
    if ref.gguf or path is not None:
        raise HubError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{ref}: a GGUF file is estimated once it is imported (name it in a config after pulling it)",
            "model",
        )
    the_plan = plan(ref)
    try:
        return footprint_of(the_plan, _download(the_plan, the_plan.support, lambda progress: None))
    except HubError:
        raise
    except Exception as error:  # noqa: BLE001 - every hub error is one line naming the repository
        raise hub_error(ref, error) from None


# -- progress ------------------------------------------------------------------------------------------------------


@dataclass
class Progress:
    """One step of a pull: ``status`` in words (as Ollama's pull records say it), and for a file being fetched
    its name, sha256, size and bytes so far."""

    status: str
    file: str = ""
    digest: str = ""
    total: int = 0
    completed: int = 0


class TailHash:
    """The sha256 of a file being written, taken as it grows by a thread of its own (reading the partial file
    back), so a pull's check runs beside the download instead of after it. Whatever goes wrong (a download that
    restarted and rewrote its start) only makes ``digest`` wrong, and a wrong digest is checked again from the
    whole file (``verify``)."""

    def __init__(self, path: Path):
        self.path = path
        self._hash = hashlib.sha256()
        self._done = 0
        self._wake = threading.Event()
        self._closing = False
        self._thread: threading.Thread | None = None

    def grew(self) -> None:
        """The file has more bytes (the download reported progress)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"sha256 {self.path.name}", daemon=True)
            self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(1.0)
            self._wake.clear()
            self._catch_up()
            if self._closing:
                self._catch_up()
                return

    def _catch_up(self) -> None:
        try:
            with open(self.path, "rb") as stream:
                stream.seek(self._done)
                while chunk := stream.read(8 * 2**20):
                    self._hash.update(chunk)
                    self._done += len(chunk)
        except OSError:
            pass

    def close(self) -> None:
        """The file is whole: hash what is left (before the client renames it)."""
        self._closing = True
        if self._thread is None:
            self._catch_up()
            return
        self._wake.set()
        self._thread.join()

    def digest(self) -> str:
        return self._hash.hexdigest()


def _bar(report: Callable[[Progress], None], remote: RemoteFile, tail: TailHash | None = None):
    """A tqdm-shaped class that ``hf_hub_download`` drives for one file, reporting its bytes (and hashing them
    as they come, with ``tail``)."""

    class Bar:
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.total = int(total or remote.size)
            self.n = int(initial or 0)
            self._sent = 0.0
            self._send(force=True)

        def _send(self, force: bool = False) -> None:
            now = time.monotonic()
            if force or now - self._sent > 0.25 or self.n >= self.total:
                self._sent = now
                digest = f"sha256:{remote.sha256}" if remote.sha256 else ""
                report(Progress(f"pulling {remote.name}", remote.name, digest, self.total, min(self.n, self.total)))

        def update(self, n=1) -> None:
            self.n += int(n or 0)
            if tail is not None:
                tail.grew()
            self._send()

        def update_transfer(self, n=1) -> None:
            pass

        def set_postfix_str(self, *args, **kwargs) -> None:
            pass

        def set_transfer_postfix_str(self, *args, **kwargs) -> None:
            pass

        def refresh(self, *args, **kwargs) -> None:
            pass

        def close(self) -> None:
            if tail is not None:
                tail.close()
            self._send(force=True)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

    return Bar


# -- pulling ---------------------------------------------------------------------------------------------------------


def _download(
    plan: Plan, files: list[RemoteFile], report: Callable[[Progress], None], digests: dict | None = None
) -> Path:
    """Fetch ``files`` into the hub cache at the plan's commit, eight at a time; the snapshot folder. Weight
    files are hashed as they come into ``digests`` (name -> sha256), where given."""
    hub = _hub()
    blobs = cache_dir() / f"models--{plan.ref.repo.replace('/', '--')}" / "blobs"

    def fetch(remote: RemoteFile) -> str:
        tail = None
        if digests is not None and remote.sha256:
            tail = TailHash(blobs / f"{remote.sha256}.incomplete")  # where the client writes an LFS file
            digests[remote.name] = tail
        bar = _bar(report, remote, tail)
        return hub.hf_hub_download(plan.ref.repo, remote.name, revision=plan.commit, tqdm_class=bar)

    if not files:
        return snapshot_folder(plan)
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(fetch, files))
    return Path(paths[0]).parent


def snapshot_folder(plan: Plan) -> Path:
    return cache_dir() / f"models--{plan.ref.repo.replace('/', '--')}" / "snapshots" / plan.commit


def verify(plan: Plan, folder: Path, report: Callable[[Progress], None], taken: dict | None = None) -> None:
    """Each weight file's sha256 against the hub's; a file that differs is deleted (its blob too) and named.
    ``taken``: digests made while the files came (``TailHash``); a file without one, or whose one differs, is
    hashed whole here."""
    for remote in plan.weights:
        if remote.sha256 is None:
            continue
        report(Progress("verifying sha256 digest", remote.name, f"sha256:{remote.sha256}", remote.size, remote.size))
        tail = (taken or {}).get(remote.name)
        if tail is not None and tail.digest() == remote.sha256:
            continue
        path = folder / remote.name
        digest = hashlib.sha256()
        with open(path, "rb") as stream:
            while chunk := stream.read(8 * 2**20):
                digest.update(chunk)
        if digest.hexdigest() != remote.sha256:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise HubError(
                grpc.StatusCode.DATA_LOSS,
                f"{plan.ref}: {remote.name} arrived with sha256 {digest.hexdigest()}, not the hub's {remote.sha256}; "
                "it was deleted (pull again)",
                "model",
            )


def check_room(plan: Plan, folder: Path | None) -> None:
    """The disk holding the hub cache has room for what is still to fetch."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    have = sum(
        (folder / f.name).stat().st_size for f in plan.files if folder is not None and (folder / f.name).exists()
    )
    needed = plan.bytes - have + DISK_MARGIN
    free = shutil.disk_usage(cache).free
    if free < needed:
        raise HubError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{plan.ref}: {needed / 2**30:.1f} GiB to fetch but {free / 2**30:.1f} GiB free on the disk of {cache}",
            "model",
        )


def check_memory(ref: ModelRef, footprint: ModelFootprint, total_memory: int) -> None:
    """The model's estimate (default settings: dtype auto, its whole context) fits this machine's memory."""
    device = expected_device()
    dtype, _ = resolve_dtype("auto", device, [footprint], total_memory)
    needed = estimate([footprint], dtype, device).total
    if needed > total_memory:
        raise HubError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{ref}: it needs about {needed / 2**30:.1f} GiB to serve (estimate) and this machine has "
            f"{total_memory / 2**30:.1f} GiB; nothing was fetched but its config",
            "model",
        )


def machine_memory() -> int:
    import psutil

    return psutil.virtual_memory().total


def pull(ref: ModelRef, report: Callable[[Progress], None] = lambda progress: None, total_memory=None) -> Path:
    """Fetch what a runner needs of ``ref`` into the hub cache (checked before the weights come: architecture,
    memory, disk; verified after); the local path a runner loads: the snapshot folder, or the GGUF file."""
    if offline():
        try:
            return cached(ref)
        except HubError:
            message = f"{ref} is not in the hub cache ({cache_dir()}) and the hub is offline (HF_HUB_OFFLINE)"
            raise not_found(message) from None
    the_plan = plan(ref)
    first = [f for f in the_plan.support if f.name in ("config.json", "adapter_config.json")]  # for the checks
    rest = [f for f in the_plan.files if f not in first]
    digests: dict[str, TailHash] = {}
    try:
        folder = _download(the_plan, first, lambda progress: None)
        if ref.gguf or not the_plan.support:
            remote = the_plan.weights[0]
            architecture = gguf_architecture(
                lambda offset, size: _read_range(ref, the_plan.commit, remote.name, offset, size)
            )
            if architecture not in GGUF_ARCHITECTURES:
                raise HubError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{ref}: GGUF architecture {architecture!r} is not one the importer handles "
                    f"({', '.join(GGUF_ARCHITECTURES)}); nothing was fetched",
                    "model",
                )
        elif (folder / "config.json").is_file():
            config = json.loads((folder / "config.json").read_text())
            check_model_type(ref, config)
            check_memory(ref, footprint_of(the_plan, folder), total_memory or machine_memory())
        elif not (folder / "adapter_config.json").is_file():  # neither a model nor an adapter (mlx-lm's)
            raise HubError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{ref}: neither a model (config.json) nor an mlx-lm LoRA adapter (adapter_config.json)",
                "model",
            )
        check_room(the_plan, folder if folder.exists() else None)
        # Its listing, config and tokenizer are here and checked: the first record (an error before it is the
        # API's status, one after it a line of the stream), then the weights.
        report(Progress("pulling manifest"))
        folder = _download(the_plan, rest, report, digests)  # the tokenizer's files beside the weights
    except HubError:
        raise
    except ValueError as error:  # a GGUF or safetensors header that cannot be read
        raise HubError(grpc.StatusCode.FAILED_PRECONDITION, f"{ref}: {error}", "model") from None
    except Exception as error:  # noqa: BLE001 - every hub error is one line naming the repository
        raise hub_error(ref, error) from None
    verify(the_plan, folder, report, digests)
    _write_ref(the_plan)
    report(Progress("success"))
    return folder / the_plan.weights[0].name if ref.gguf or not the_plan.support else folder


def _write_ref(plan: Plan) -> None:
    """The revision's ref in the cache (what huggingface_hub writes too), so an offline lookup finds it."""
    refs = cache_dir() / f"models--{plan.ref.repo.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / (plan.ref.revision or "main")).write_text(plan.commit)


def cached(ref: ModelRef) -> Path:
    """The local path of ``ref`` if the hub cache holds what a runner needs of it (no network); else a
    NOT_FOUND HubError."""
    repo_folder = cache_dir() / f"models--{ref.repo.replace('/', '--')}"
    commit = ref.revision or "main"
    ref_file = repo_folder / "refs" / commit
    if ref_file.is_file():
        commit = ref_file.read_text().strip()
    folder = repo_folder / "snapshots" / commit
    if not folder.is_dir():
        raise not_found(f"{ref} is not in the hub cache ({cache_dir()})")
    names = [p.name for p in folder.iterdir()]
    if ref.file or ref.quant:
        remote = [RemoteFile(n, 0, None) for n in names if n.lower().endswith(".gguf")]
        try:
            _, chosen = choose_files(ref, remote)
        except HubError:
            raise not_found(f"{ref} is not in the hub cache ({cache_dir()})") from None
        return folder / chosen[0].name
    if "adapter_config.json" in names and "adapters.safetensors" in names:  # an mlx-lm LoRA adapter
        return folder
    if "config.json" not in names or not any(fnmatch.fnmatch(n, "*.safetensors") for n in names):
        ggufs = [n for n in names if n.lower().endswith(".gguf")]
        if ggufs:
            return folder / sorted(ggufs)[0]
        raise not_found(f"{ref} is not in the hub cache ({cache_dir()}) whole: pull it")
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # every shard the index names must be here
        shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        if not shards <= set(names):
            raise not_found(f"{ref} is only partly in the hub cache: pull it")
    return folder


@dataclass
class CachedModel:
    ref: str  # as a request names it
    path: Path
    size: int
    modified: float


def cached_models() -> list[CachedModel]:
    """The models in the hub cache that a runner can load (mlx-lm folders whole, GGUF files): what may be served
    by name under ``pull = "cached"``."""
    out = []
    root = cache_dir()
    if not root.is_dir():
        return out
    for repo_folder in sorted(root.glob("models--*--*")):
        repo = repo_folder.name.removeprefix("models--").replace("--", "/", 1)
        ref = ModelRef(repo)
        try:
            path = cached(ref)
        except HubError:
            continue
        if path.is_dir() and not (path / "config.json").is_file():  # a LoRA adapter, not a model
            continue
        if path.suffix == ".gguf":
            ref = ModelRef(repo, file=path.name)
        files = [path] if path.is_file() else list(path.iterdir())
        size = sum(p.stat().st_size for p in files if p.exists())
        out.append(CachedModel(str(ref), path, size, max((p.stat().st_mtime for p in files), default=0.0)))
    return out


def delete(ref: ModelRef) -> int:
    """Remove a repository from the hub cache; the bytes freed."""
    repo_folder = cache_dir() / f"models--{ref.repo.replace('/', '--')}"
    if not repo_folder.is_dir():
        raise not_found(f"{ref.repo} is not in the hub cache ({cache_dir()})")
    size = sum(p.stat().st_size for p in repo_folder.rglob("*") if p.is_file() and not p.is_symlink())
    shutil.rmtree(repo_folder)
    return size


# -- pulls shared within the process ---------------------------------------------------------------------------


@dataclass
class PullJob:
    """One pull in flight: its progress records so far (for a late subscriber: the latest of each file) and,
    once done, its path or error."""

    ref: ModelRef
    done: threading.Event = field(default_factory=threading.Event)
    path: Path | None = None
    error: Exception | None = None
    latest: dict[str, Progress] = field(default_factory=dict)
    watch: Callable[[PullJob], None] | None = None  # told of every step (the supervisor's metrics)
    _listeners: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self, progress: Progress) -> None:
        with self._lock:
            self.latest[progress.file or progress.status] = progress
            listeners = list(self._listeners)
        for listener in listeners:
            listener(progress)
        if self.watch is not None:
            self.watch(self)

    @property
    def bytes(self) -> tuple[int, int]:
        """(completed, total) over the files seen so far."""
        files = [p for p in list(self.latest.values()) if p.file]
        return sum(p.completed for p in files), sum(p.total for p in files)

    def listen(self, listener: Callable[[Progress], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            seen = list(self.latest.values())
        for progress in seen:
            listener(progress)

    def forget(self, listener) -> None:
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)


async def follow(job: PullJob):
    """A pull's progress on an asyncio loop (``async for``), from the thread that pulls; its error at the end."""
    import asyncio

    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def listener(progress: Progress) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, progress)

    job.listen(listener)
    waiting = loop.run_in_executor(None, job.done.wait)
    try:
        while True:
            getting = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait({getting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if getting in done:
                yield getting.result()
                continue
            getting.cancel()
            while not queue.empty():
                yield queue.get_nowait()
            break
    finally:
        job.forget(listener)
    if job.error is not None:
        raise job.error


class Pulls:
    """The pulls of one process: a second pull of a repository already being pulled joins the first."""

    def __init__(self, total_memory: int | None = None):
        self._jobs: dict[str, PullJob] = {}
        self._lock = threading.Lock()
        self.total_memory = total_memory
        self.watch: Callable[[PullJob], None] | None = None  # given to each job

    def start(self, ref: ModelRef) -> PullJob:
        key = str(ref)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not job.done.is_set():
                return job
            job = self._jobs[key] = PullJob(ref, watch=self.watch)
        threading.Thread(target=self._run, args=(job,), name=f"pull {key}", daemon=True).start()
        return job

    def _run(self, job: PullJob) -> None:
        import logging

        log = logging.getLogger("supervisor")
        logged = LoggedProgress(str(job.ref), logger=log)
        started = time.monotonic()
        log.info("pull %s: started (%s)", job.ref, environment_note())

        def report(progress: Progress) -> None:
            job.report(progress)
            logged(progress)

        try:
            job.path = pull(job.ref, report, self.total_memory)
            log.info("pull %s: done in %.1f s (%s)", job.ref, time.monotonic() - started, job.path)
        except Exception as error:  # noqa: BLE001 - handed to whoever waits
            job.error = error
            log.warning("pull %s: failed after %.1f s: %s", job.ref, time.monotonic() - started, error)
        finally:
            job.done.set()
            if job.watch is not None:
                job.watch(job)

    def in_flight(self) -> list[PullJob]:
        with self._lock:
            return [job for job in self._jobs.values() if not job.done.is_set()]


class LoggedProgress:
    """A pull's progress as log lines: each step, and a file's bytes at most every ``every`` seconds."""

    def __init__(self, name: str, every: float = 5.0, logger=None):
        import logging

        self.name, self.every = name, every
        self.log = logger or logging.getLogger("supervisor")
        self._last: dict[str, float] = {}

    def __call__(self, progress: Progress) -> None:
        now = time.monotonic()
        if progress.file and progress.total and progress.completed < progress.total:
            if now - self._last.get(progress.file, 0.0) < self.every:
                return
        self._last[progress.file] = now
        if progress.total:
            self.log.info("%s: %.1f of %.1f MiB", progress.status, progress.completed / 2**20, progress.total / 2**20)
        else:
            self.log.info("%s", progress.status)


def environment_note() -> str:
    """Where the cache is and whether the hub may be reached, for a log line."""
    state = "offline (HF_HUB_OFFLINE)" if offline() else f"hub {os.environ.get('HF_ENDPOINT', 'huggingface.co')}"
    return f"hub cache {cache_dir()}, {state}"
