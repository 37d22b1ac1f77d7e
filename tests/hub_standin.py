"""A stand-in for the Hugging Face hub, for the tests: no hub can be reached from this machine.

A small threaded HTTP server that speaks the part of the hub's protocol the real ``huggingface_hub`` client uses
when it is pointed at it with ``HF_ENDPOINT``: model info with each file's size and sha256
(``GET /api/models/{repo}[/revision/{rev}]``, ``?blobs=true``), and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``
with ``X-Repo-Commit``, ``ETag`` (a file's sha256 for a weight file, as the hub's LFS files have; a git blob id
for a small one), ``Content-Length`` and byte ranges, so an interrupted download resumes. Errors carry the hub's
``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``, ``EntryNotFound``, ``GatedRepo``), which the client
turns into its own exceptions.

It serves real files (a model folder, a GGUF file, an adapter), and can be told to misbehave as a network or a
hub might: cut a file's first transfer after some bytes, or serve a file whose bytes differ from its published
sha256. It counts what was asked of it, so a test can tell that no weight was fetched.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pth", ".pt", ".npz")


@dataclass
class Repo:
    """One repository at one commit: its files (a path on disk or bytes), by their names in the repo."""

    files: dict[str, Path | bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    gated: bool = False  # only a request with the hub's token may read it
    sha256: dict[str, str] = field(default_factory=dict)  # computed once

    def data(self, name: str) -> bytes:
        value = self.files[name]
        return value if isinstance(value, bytes) else Path(value).read_bytes()

    def size(self, name: str) -> int:
        value = self.files[name]
        return len(value) if isinstance(value, bytes) else Path(value).stat().st_size

    def digest(self, name: str) -> str:
        if name not in self.sha256:
            self.sha256[name] = hashlib.sha256(self.data(name)).hexdigest()
        return self.sha256[name]

    def is_lfs(self, name: str) -> bool:
        return name.endswith(LFS_SUFFIXES)

    def etag(self, name: str) -> str:
        if self.is_lfs(name):
            return self.digest(name)
        data = self.data(name)  # a small file's git blob id, as the hub's ETag for it
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandInHub:
    """The server: ``with StandInHub({"org/name": Repo(...)}) as hub: ... hub.endpoint``."""

    TOKEN = "hf_standin_token"  # what a gated repo wants as its bearer token

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.cut: dict[str, int] = {}  # file name -> bytes after which its next transfer is cut (once)
        self.corrupt: set[str] = set()  # file names served with one byte changed
        self.rate: dict[str, float] = {}  # repo -> bytes per second its files are sent at (a slow link)
        self.fetched: list[tuple[str, str, str, str]] = []  # (method, repo, file, Range) of every resolve request
        self.sent: dict[tuple[str, str], int] = {}  # (repo, file) -> bytes of it sent
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub._handle(self, head=False)

            def do_HEAD(self):
                hub._handle(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="stand-in hub", daemon=True)

    def __enter__(self) -> StandInHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def weight_bytes_sent(self, repo: str) -> int:
        """Bytes of ``repo``'s weight files sent so far (a pull's checks read only their headers)."""
        with self._lock:
            return sum(n for (r, f), n in self.sent.items() if r == repo and f.endswith(LFS_SUFFIXES))

    def requests(self, repo: str, name: str) -> list[tuple[str, str]]:
        """(method, Range header) of every request for one file."""
        with self._lock:
            return [(method, ranged) for method, r, f, ranged in self.fetched if r == repo and f == name]

    def _repo_of(self, repo: Repo) -> str:
        return next(name for name, value in self.repos.items() if value is repo)

    # -- requests ---------------------------------------------------------------------------------------------

    def _error(self, request, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        request.send_response(status)
        request.send_header("X-Error-Code", code)
        request.send_header("X-Error-Message", message)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        request.wfile.write(body)

    def _repo(self, request, repo_id: str, revision: str | None) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(request, 404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and request.headers.get("Authorization") != f"Bearer {self.TOKEN}":
            self._error(
                request,
                403,
                "GatedRepo",
                f"Access to model {repo_id} is restricted and you are not in the authorized list.",
            )
            return None
        if revision not in (None, "main", repo.commit):
            self._error(request, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return repo

    def _handle(self, request, head: bool) -> None:
        path = request.path.split("?", 1)[0]
        info = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if info:
            repo = self._repo(request, info.group(1), info.group(2))
            if repo is not None:
                self._model_info(request, info.group(1), repo, head)
            return
        tree = re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/.*)?", path)
        if tree:
            repo = self._repo(request, tree.group(1), tree.group(2))
            if repo is not None:
                self._tree(request, repo, head)
            return
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if resolve is None:
            self._error(request, 404, "EntryNotFound", f"no such path {path}")
            return
        repo_id, revision, name = resolve.groups()
        with self._lock:
            self.fetched.append(("HEAD" if head else "GET", repo_id, name, request.headers.get("Range", "")))
        repo = self._repo(request, repo_id, revision)
        if repo is None:
            return
        if name not in repo.files:
            self._error(request, 404, "EntryNotFound", f"{name} does not exist in {repo_id}")
            return
        self._file(request, repo, name, head)

    def _model_info(self, request, repo_id: str, repo: Repo, head: bool) -> None:
        siblings = []
        for name in sorted(repo.files):
            entry = {"rfilename": name, "size": repo.size(name), "blobId": repo.etag(name)}
            if repo.is_lfs(name):
                entry["lfs"] = {"sha256": repo.digest(name), "size": repo.size(name), "pointerSize": 134}
            siblings.append(entry)
        body = {
            "_id": repo_id,
            "id": repo_id,
            "modelId": repo_id,
            "sha": repo.commit,
            "private": False,
            "gated": "auto" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["mlx"],
            "library_name": "mlx",
            "siblings": siblings,
            "createdAt": "2026-01-01T00:00:00.000Z",
            "lastModified": "2026-01-01T00:00:00.000Z",
        }
        self._json(request, body, head)

    def _tree(self, request, repo: Repo, head: bool) -> None:
        """The repo's files, as the hub's tree listing gives them (one page)."""
        entries = []
        for name in sorted(repo.files):
            entry = {"type": "file", "oid": repo.etag(name), "size": repo.size(name), "path": name}
            if repo.is_lfs(name):
                entry["lfs"] = {"oid": repo.digest(name), "size": repo.size(name), "pointerSize": 134}
            entries.append(entry)
        self._json(request, entries, head)

    def _json(self, request, value, head: bool) -> None:
        body = json.dumps(value).encode()
        request.send_response(200)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(body)))
        request.end_headers()
        if not head:
            request.wfile.write(body)

    def _file(self, request, repo: Repo, name: str, head: bool) -> None:
        size = repo.size(name)
        start, end = 0, size - 1
        ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
        if ranged:
            start = int(ranged.group(1))
            end = int(ranged.group(2)) if ranged.group(2) else size - 1
        request.send_response(206 if ranged else 200)
        request.send_header("X-Repo-Commit", repo.commit)
        request.send_header("ETag", f'"{repo.etag(name)}"')
        if repo.is_lfs(name):
            request.send_header("X-Linked-Etag", f'"{repo.etag(name)}"')
            request.send_header("X-Linked-Size", str(size))
        request.send_header("Accept-Ranges", "bytes")
        request.send_header("Content-Length", str(end - start + 1))
        if ranged:
            request.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        request.end_headers()
        if head:
            return
        data = repo.data(name)
        if name in self.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        piece = data[start : end + 1]
        with self._lock:
            cut = self.cut.get(name)
            if cut is not None and cut < len(piece):  # this transfer is long enough to be cut: cut once
                del self.cut[name]
            else:
                cut = None
            sent = len(piece) if cut is None else min(cut, len(piece))
            self.sent[(self._repo_of(repo), name)] = self.sent.get((self._repo_of(repo), name), 0) + sent
        if cut is not None and cut < len(piece):  # the connection drops mid-file, once
            request.wfile.write(piece[:cut])
            request.wfile.flush()
            request.close_connection = True
            request.connection.shutdown(2)
            return
        rate = self.rate.get(self._repo_of(repo))
        for offset in range(0, len(piece), 1 << 20):
            request.wfile.write(piece[offset : offset + (1 << 20)])
            if rate:
                time.sleep((1 << 20) / rate)
