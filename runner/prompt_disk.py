"""The prompt cache's disk tier: warm prefixes that outlive the runner process.

A keep-alive unload, a crash restart or the memory policy's drain-and-restart
ends a runner and, with it, every KV cache its prompt cache held: an agent's
thousands of tokens of system prompt and tool definitions would be prefilled
again. With ``prompt_cache_dir`` set, every entry the prompt cache keeps that
is worth it (at least ``MIN_DISK_TOKENS`` tokens) is also written to disk when
it is stored, so it is there after a clean stop, a ``kill -9`` or an out-of-
memory kill alike; an entry the memory tier evicts (or the memory policy
empties) stays on disk. A later lookup, in this process or the next, that
finds a longer shared prefix on disk than in memory loads it back.

- **Whole or not at all.** A file is written beside its final name
  (``partial-*.safetensors``) and renamed once complete; its name carries the
  CRC-32 of its bytes, checked before it is used. A file cut short or
  corrupted fails that check, or mlx-lm's loader, and is logged, removed and
  ignored; leftover partial files are removed at start.
- **Never another model's.** Files live in a folder named by the runner's
  identity: the target's and the draft's config, tokenizer and weight files
  (names, sizes, modification times), the dtype they compute in, and the
  cache's format. Each file records the whole identity too, so one copied in
  from another model is logged and ignored.
- **Its own budget.** ``prompt_cache_disk`` bytes; the least recently used
  files go first. It never counts against the runner's memory: the memory
  policy may empty the memory tier, and what it empties is already on disk.

The format is mlx-lm's ``save_prompt_cache`` (safetensors, every cache kind
mlx-lm has); the target's and the draft's layers go in one file. Writing
happens on the MLX thread when a request ends (a 3000-token entry of the
default pair takes ~10 ms; see bench/prompt_cache.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

log = logging.getLogger("runner")

FORMAT = 1  # bump when what a file holds changes meaning
MIN_DISK_TOKENS = 256  # a shorter prefix prefills faster than it loads
SUFFIX = ".safetensors"
PARTIAL = "partial-"


def model_identity(path: Path | None) -> dict | None:
    """What makes a model folder's caches its own: config and tokenizer contents, weight files' sizes and times."""
    if path is None:
        return None
    path = Path(path)
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    weights = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in path.iterdir()
        if f.suffix in (".safetensors", ".npz", ".gguf")
    )
    return {"path": str(path.resolve()), "files": digest.hexdigest(), "weights": weights}


def identity_of(target: Path, draft: Path | None, dtype: str) -> str:
    """One hash of everything that decides what a cache holds (``model_identity`` of both models, the dtype)."""
    whole = {"format": FORMAT, "target": model_identity(target), "draft": model_identity(draft), "dtype": dtype}
    return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(2**22):
            crc = zlib.crc32(block, crc)
    return crc


def tokens_key(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:32]


@dataclass
class DiskEntry:
    tokens: list[int]
    path: Path
    nbytes: int
    used: float  # the last time it was written or read (its file's mtime)
    trimmable: bool  # usable for a shorter shared prefix too (every layer can drop its last tokens)


class DiskTier:
    def __init__(self, root: Path, budget: int, identity: str):
        self.identity = identity
        self.folder = Path(root) / identity[:24]
        self.budget = budget
        self.entries: dict[str, DiskEntry] = {}
        self.nbytes = 0
        self.hits = 0
        self.writes = 0
        self.evictions = 0
        self.failures = 0  # files found bad (cut short, corrupted, another model's) and ignored
        self.write_seconds = 0.0  # spent writing entries (on the MLX thread, as requests end)
        self.read_seconds = 0.0  # spent checking and loading entries back
        self.folder.mkdir(parents=True, exist_ok=True)
        self._scan()

    # -- start-up -----------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the folder's files by their tokens (from each file's header, not its arrays)."""
        from safetensors import safe_open

        for file in sorted(self.folder.iterdir()):
            if file.name.startswith(PARTIAL):
                file.unlink(missing_ok=True)  # a write that never finished
                continue
            if file.suffix != SUFFIX:
                continue
            try:
                with safe_open(str(file), "numpy") as opened:
                    metadata = opened.metadata() or {}
                identity = metadata.get("0.identity")
                tokens = json.loads(metadata["0.tokens"])
                trimmable = metadata["0.trimmable"] == "1"
            except Exception as error:  # noqa: BLE001 - any unreadable header is a bad file
                self._bad(file, f"unreadable ({type(error).__name__}: {error})")
                continue
            if identity != self.identity:
                self.failures += 1
                log.warning("prompt cache: %s is another model's cache (or another dtype or format): ignored", file)
                continue
            stat = file.stat()
            self.entries[file.name] = DiskEntry(tokens, file, stat.st_size, stat.st_mtime, trimmable)
            self.nbytes += stat.st_size
        self._fit(0)
        if self.entries:
            log.info("prompt cache: %d entries (%d bytes) on disk in %s", len(self.entries), self.nbytes, self.folder)

    def _bad(self, file: Path, why: str) -> None:
        self.failures += 1
        log.warning("prompt cache: %s is %s: removed", file, why)
        file.unlink(missing_ok=True)

    # -- the tier -----------------------------------------------------------------------------------

    def best(self, prompt: list[int], limit: int) -> tuple[str | None, int]:
        """(name, shared tokens) of the file sharing the longest usable prefix with ``prompt`` (at most ``limit``;
        an entry that cannot be trimmed only whole)."""
        from .prompt_cache import common_prefix

        best_name, best = None, 0
        for name, entry in self.entries.items():
            shared = min(common_prefix(entry.tokens, prompt), limit)
            if shared > best and (entry.trimmable or shared == len(entry.tokens)):
                best_name, best = name, shared
        return best_name, best

    def load(self, name: str) -> tuple[list[int], list[list]] | None:
        """(tokens, caches per model) of one file, checked; None (logged, removed) when it is not whole."""
        started = time.perf_counter()
        entry = self.entries.pop(name)
        self.nbytes -= entry.nbytes
        expected = name.removesuffix(SUFFIX).rsplit("-", 1)[-1]
        try:
            if f"{crc32_of(entry.path):08x}" != expected:
                raise ValueError("its CRC-32 differs from its name's")
            layers, metadata = load_prompt_cache(str(entry.path), return_metadata=True)
            if metadata.get("identity") != self.identity or json.loads(metadata["tokens"]) != entry.tokens:
                raise ValueError("its contents changed since it was indexed")
            counts = json.loads(metadata["layers"])
        except Exception as error:  # noqa: BLE001 - a file that does not load is a bad file, whatever the cause
            self._bad(entry.path, f"not a whole cache ({type(error).__name__}: {error})")
            return None
        self.hits += 1
        self.read_seconds += time.perf_counter() - started
        os.utime(entry.path)  # recently used
        entry.used = entry.path.stat().st_mtime
        self.entries[name] = entry
        self.nbytes += entry.nbytes
        caches, start = [], 0
        for count in counts:
            caches.append(layers[start : start + count] if count else None)
            start += count
        return list(entry.tokens), caches

    def holds(self, tokens: list[int]) -> bool:
        return any(name.startswith(tokens_key(tokens)) for name in self.entries)

    def store(self, tokens: list[int], caches: list[list]) -> None:
        """Write one entry (unless it is short or already there); entries it extends are removed."""
        if len(tokens) < MIN_DISK_TOKENS or self.holds(tokens):
            return
        from mlx_lm.models.cache import can_trim_prompt_cache

        from .prompt_cache import common_prefix

        started = time.perf_counter()
        layers = [layer for model in caches if model for layer in model]
        counts = [len(model) if model else 0 for model in caches]
        partial = self.folder / f"{PARTIAL}{uuid.uuid4().hex}{SUFFIX}"
        trimmable = can_trim_prompt_cache(layers)
        metadata = {
            "identity": self.identity,
            "tokens": json.dumps(tokens),
            "layers": json.dumps(counts),
            "trimmable": "1" if trimmable else "0",
        }
        try:
            save_prompt_cache(str(partial), layers, metadata)
            size = partial.stat().st_size
            if size > self.budget:
                partial.unlink()
                return
            final = self.folder / f"{tokens_key(tokens)}-{crc32_of(partial):08x}{SUFFIX}"
            os.replace(partial, final)
        except OSError as error:  # a full or read-only disk costs the tier, never the request
            log.warning("prompt cache: cannot write to %s: %s", self.folder, error)
            partial.unlink(missing_ok=True)
            return
        self.writes += 1
        self.write_seconds += time.perf_counter() - started
        for name in [n for n, e in self.entries.items() if common_prefix(e.tokens, tokens) == len(e.tokens)]:
            self._remove(name)  # the new entry holds all it did
        stat = final.stat()
        self.entries[final.name] = DiskEntry(list(tokens), final, stat.st_size, stat.st_mtime, trimmable)
        self.nbytes += stat.st_size
        self._fit(0)

    def _fit(self, room: int) -> None:
        while self.entries and self.nbytes + room > self.budget:
            oldest = min(self.entries, key=lambda n: self.entries[n].used)
            self._remove(oldest)
            self.evictions += 1

    def _remove(self, name: str) -> None:
        entry = self.entries.pop(name)
        self.nbytes -= entry.nbytes
        entry.path.unlink(missing_ok=True)
