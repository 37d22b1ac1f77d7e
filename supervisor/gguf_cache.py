"""GGUF files named in the config: imported once into mlx-lm folders the runners load.

A model's ``target`` (or ``draft``) may be a ``.gguf`` file. When the config is
loaded, the supervisor imports it with the GGUF importer (``python -m
runner.gguf``, in a child process: the supervisor itself never loads MLX) into
``<gguf_cache_dir>/<file stem>-<key>``, where the key hashes the file's resolved
path, size and modification time. So a file is imported once and reused at every
start after; a file changed in place gets a new folder.

The importer writes into a temporary folder beside the final one, which is renamed
into place only when the import has finished: an import cut short (killed, disk
full) is never taken for a finished one, and the next start imports again. The
next finished import removes what one cut short left behind, once nothing has
written to it for a day (``abandoned_imports``). An
importer refusal (an architecture, quantization type or vocabulary it does not
handle) comes back as a ``GGUFCacheError`` carrying the importer's one line.

Each import records the file it came from (``source.json``: its resolved path,
size and modification time, and the device its filesystem was on). An import
whose file has since changed or gone no start can reach again (the key names
what the file was), so each new import removes those, as Ollama prunes its
unreferenced blobs: a GGUF file downloaded again, or one from a folder since
deleted, left its whole import behind for good. A file whose filesystem is not
there now (its nearest existing folder is on another device: a drive
unplugged, a share not mounted) is not gone: it may come back as it was, and a
large model's import costs minutes, so its import stays. Imports a caller still
uses (``keep``) and imports made before records were kept are left alone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)


SOURCE = "source.json"  # in each import: the GGUF file it was made from


class GGUFCacheError(ValueError):
    """The file could not be imported; the message says why in one line."""


def default_cache_dir(kind: str = "gguf") -> Path:
    """``$XDG_CACHE_HOME/mlxserve/KIND`` (else ``~/.cache/mlxserve/KIND``): "gguf" imports, "kernels" for
    MLX's compiled GPU kernels (``kernel_cache_dir``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlxserve" / kind


def folder_for(source: Path, cache_dir: Path) -> Path:
    """Where ``source`` is (or will be) imported: its stem and a key of its path, size and modification time."""
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_dir / f"{source.stem}-{key}"


def imported_folder(source: Path, cache_dir: Path, keep=()) -> Path:
    """The mlx-lm folder imported from the GGUF file ``source``, importing it first if it is not there yet (and
    then removing the imports no start can reach again, but those in ``keep``: folders in use)."""
    if not source.is_file():
        raise GGUFCacheError(f"no such file: {source}")
    folder = folder_for(source, cache_dir)
    if (folder / "config.json").is_file():
        return folder
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise GGUFCacheError(f"cannot create {cache_dir}: {error.strerror}") from None
    # Named for this process and at random: supervisors in other containers sharing the folder may have its pid.
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    shutil.rmtree(folder, ignore_errors=True)  # the folder without config.json is no finished import
    log.info("importing %s into %s (once: later starts reuse it)", source, folder)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "runner.gguf", str(source), str(partial)], capture_output=True, text=True
    )
    if done.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        lines = done.stderr.strip().splitlines() or [f"the importer exited with status {done.returncode}"]
        raise GGUFCacheError(lines[-1].removeprefix("runner.gguf: "))
    stat = source.stat()
    record = {"path": str(source.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "device": stat.st_dev}
    (partial / SOURCE).write_text(json.dumps(record))
    try:
        partial.rename(folder)
    except OSError:  # another supervisor finished the same import first
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    log.info("imported %s in %.1f s", source.name, time.monotonic() - started)
    for stale, why in unreachable_imports(cache_dir, keep={folder, *keep}) + abandoned_imports(cache_dir):
        log.info("removing %s: %s (no start can use it again)", stale, why)
        shutil.rmtree(stale, ignore_errors=True)
    return folder


def unreachable_imports(cache_dir: Path, keep=()) -> list[tuple[Path, str]]:
    """(folder, why) for each finished import in ``cache_dir`` whose GGUF file is gone or has changed since (its
    ``source.json``), but those in ``keep``. Imports without a record, and unfinished ones, are not listed."""
    keep = {Path(k) for k in keep if k}
    found = []
    for child in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else ():
        if child in keep or ".partial-" in child.name or not (child / SOURCE).is_file():
            continue
        try:
            record = json.loads((child / SOURCE).read_text())
            path, size, mtime_ns = Path(record["path"]), int(record["size"]), int(record["mtime_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            stat = path.stat()
        except FileNotFoundError:
            if not _unmounted(path, record.get("device")):
                found.append((child, f"{path} is gone"))
            continue
        except OSError:
            continue
        if (stat.st_size, stat.st_mtime_ns) != (size, mtime_ns):
            found.append((child, f"{path} has changed since it was imported"))
    return found


ABANDONED_AFTER = 86400.0  # seconds without a write after which an unfinished import is taken for abandoned


def abandoned_imports(cache_dir: Path) -> list[tuple[Path, str]]:
    """(folder, why) for each unfinished import (``*.partial-*``) in ``cache_dir`` that nothing has written to for
    ``ABANDONED_AFTER`` seconds: what a supervisor killed while importing left behind (a large model's worth of
    disk, which its next start, under another pid, never looked at). An import under way writes as it goes; a day
    leaves room for one that converts for hours before it writes."""
    now, found = time.time(), []
    for child in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else ():
        if ".partial-" not in child.name:
            continue
        try:
            written = max([child.stat().st_mtime, *(p.stat().st_mtime for p in child.rglob("*"))])
        except OSError:  # being renamed or removed by its owner
            continue
        if now - written > ABANDONED_AFTER:
            found.append((child, f"an import left unfinished {(now - written) / 3600:.0f} h ago"))
    return found


def _unmounted(path: Path, device) -> bool:
    """Whether a missing ``path`` was on a filesystem that is not there now (a drive unplugged, a share not
    mounted): its nearest existing folder is on another device than the file was (``device``, its st_dev when it
    was imported). Then the file may come back as it was, and its import is kept. Records from before devices
    were kept say nothing (False)."""
    if not isinstance(device, int):
        return False
    for folder in path.parents:
        try:
            return folder.stat().st_dev != device
        except FileNotFoundError:
            continue
        except OSError:
            return True  # cannot tell: keep the import
    return False
