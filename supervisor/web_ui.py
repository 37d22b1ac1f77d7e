"""The web page (docs/web.md): a chat with any model and a view of the runners, served by the HTTP API's app.

    GET /                    the page, to a browser (``Accept: text/html``); anyone else still gets Ollama's
                             "Ollama is running" (supervisor.ollama_api), which its clients and health checks ask
    GET /web/{file}          its scripts, styles and vendored libraries (supervisor/web/), nothing else
    GET /mlxserve/status     GetStatus as JSON (the token, as every API), with each runner's uptime and the
                             cause of its last restart: what the page's runners view draws

The page itself holds no data and needs no token; everything it shows comes from the APIs, which do. Every
file goes out with a Content-Security-Policy that lets the page load and connect to its own origin only, run
no inline script and be framed by no one: a model's answer is Markdown rendered in the browser and sanitised
(DOMPurify) before it reaches the document, and the policy is the second wall should the sanitiser miss.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match, Route

from common import __version__
from common.status import Code, ServiceError

FOLDER = Path(__file__).resolve().parent / "web"
TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
# Scripts, styles, images and connections from this origin only; images also as data: and blob: URLs (an attached
# picture's preview); no inline script or style attribute, no plugin, no form posted anywhere, no framing.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "font-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}


def files() -> dict[str, Path]:
    """The files the page may load, by their path under /web/ (read once: nothing else under the folder is served)."""
    return {
        path.relative_to(FOLDER).as_posix(): path
        for path in sorted(FOLDER.rglob("*"))
        if path.is_file() and path.suffix in TYPES
    }


class BrowserRoute(Route):
    """A route that matches a browser's request only (one that accepts HTML), so that every other client of the
    same path reaches the route after it (Ollama's root)."""

    def matches(self, scope):
        match, child = super().matches(scope)
        if match == Match.NONE:
            return match, child
        accept = dict(scope.get("headers", ())).get(b"accept", b"")
        return (match, child) if b"text/html" in accept else (Match.NONE, {})


def served(path: Path) -> Response:
    return FileResponse(path, media_type=TYPES[path.suffix], headers=HEADERS)


def runner_extras(runner) -> dict:
    """What GetStatus does not carry: how long the runner process has run and why it last restarted."""
    uptime = 0.0
    if runner.pid:
        try:
            uptime = max(0.0, time.time() - psutil.Process(runner.pid).create_time())
        except psutil.Error:
            pass
    return {
        "uptime_s": round(uptime, 1),
        "last_failure": runner.last_failure,
        "last_failure_s_ago": round(time.time() - runner.last_failure_at, 1) if runner.last_failure_at else None,
    }


def register(app: FastAPI, supervisor, authorized) -> None:
    """Add the page's routes to the HTTP API's app (before Ollama's, whose root it shares)."""
    served_files = files()
    index = served_files["index.html"]

    async def page(request: Request):
        return served(index)

    app.router.routes.append(BrowserRoute("/", page, methods=["GET", "HEAD"], include_in_schema=False))

    @app.get("/web/{name:path}", include_in_schema=False)
    async def asset(name: str):
        path = served_files.get(name)
        if path is None:
            raise ServiceError(Code.NOT_FOUND, f"/web/{name}: no such file")
        return served(path)

    @app.get("/mlxserve/status", dependencies=[Depends(authorized)])
    async def status():
        """GetStatus's fields (proto/supervisor.proto), each model's with ``runner_extras``."""
        scheduler = supervisor.scheduler
        models = []
        for runner in list(scheduler.runners.values()):
            model = as_dict(supervisor.status(runner))
            model.update(runner_extras(runner))
            models.append(model)
        pulls = []
        for job in scheduler.pulls.in_flight():
            steps = list(job.latest.values())
            completed, total = job.bytes
            pulls.append(
                {
                    "model": str(job.ref),
                    "total": total,
                    "completed": completed,
                    "status": steps[-1].status if steps else "starting",
                }
            )
        body = {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": time.monotonic() - supervisor.started,
            "ready": scheduler.ready,
            "models": models,
            "max_loaded": supervisor.config.loaded_cap,
            "pulls": pulls,
            "cached": await run_in_threadpool(scheduler.cached_names),
            "pull": supervisor.config.pull,
            "auth": bool(supervisor.config.auth_token),
            "time": time.time(),
        }
        return JSONResponse(body, headers={"Cache-Control": "no-store"})


def as_dict(message) -> dict:
    """A protobuf message as JSON-ready values: numbers as numbers (protobuf's own JSON mapping writes 64-bit
    integers as strings), enums by name, every field present."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.type == field.TYPE_MESSAGE:
            value = [as_dict(v) for v in value] if field.is_repeated else as_dict(value)
        elif field.type == field.TYPE_ENUM:
            enum = field.enum_type.values_by_number
            value = [enum[v].name for v in value] if field.is_repeated else enum[value].name
        elif field.is_repeated:
            value = list(value)
        out[field.name] = value
    return out
