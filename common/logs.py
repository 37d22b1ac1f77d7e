"""Logs a person reads and a collector parses: one record per event, one timestamp, the model and pid as fields.

Both processes log through ``setup``. A runner started by the supervisor logs JSON, one object per line, on
its stderr (``--log-format json``); the supervisor reads each line back into a record of its own logger
(``record_from_json``) with the runner's timestamp, level, model and pid, so the supervisor's log shows one
record per event, never a runner's line wrapped in a second prefix. A line that is not JSON (a traceback, a
C library's message) becomes a record with the model and pid too.

Two formats, for the supervisor's log (``log_format`` in its config) and for a runner started by hand:

- ``text``: ``2026-12-04 11:04:52,579 INFO runner[default:2971] listening on ...``
- ``json``: ``{"time": "2026-12-04T11:04:52.579+00:00", "level": "INFO", "process": "runner", "model":
  "default", "pid": 2971, "message": "listening on ..."}``, plus ``exception`` when there is one.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import UTC, datetime

LOG_FORMATS = ("text", "json")


class TextFormatter(logging.Formatter):
    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(source)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.source = source_of(record)
        text = super().format(record)
        if getattr(record, "exception", None) and not record.exc_info:  # a runner's traceback, read back
            text += "\n" + record.exception
        return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        process, model, pid = who(record)
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "process": process,
            "model": model,
            "pid": pid,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif getattr(record, "exception", None):
            entry["exception"] = record.exception
        return json.dumps(entry, ensure_ascii=False)


def who(record: logging.LogRecord) -> tuple[str, str | None, int]:
    """The process that wrote the record ("runner" or "supervisor"), its model (a runner's) and its pid: the
    fields ``setup`` or ``record_from_json`` stamped, else this process's logger name and pid."""
    name = getattr(record, "process_name", None) or record.name.split(".")[0]
    return name, getattr(record, "model", None), getattr(record, "pid", None) or record.process


def source_of(record: logging.LogRecord) -> str:
    """``runner[model:pid]`` or ``supervisor[pid]``: who wrote the record."""
    name, model, pid = who(record)
    return f"{name}[{model}:{pid}]" if model else f"{name}[{pid}]"


class ConsoleHandler(logging.StreamHandler):
    """stderr, with a pause: between ``pause`` and ``resume`` records wait and come out together afterwards,
    so a block of output (``make run``'s sample answers) is not cut by log lines. (Not ``hold``/``release``:
    ``Handler.release`` is the handler's lock.)"""

    def __init__(self, stream=None):
        super().__init__(stream or sys.stderr)
        self._held: list[logging.LogRecord] | None = None
        self._hold_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._hold_lock:
            if self._held is not None:
                self._held.append(record)
                return
        super().emit(record)

    def pause(self) -> None:
        with self._hold_lock:
            if self._held is None:
                self._held = []

    def resume(self) -> None:
        with self._hold_lock:
            held, self._held = self._held or [], None
        for record in held:
            super().emit(record)


def setup(process_name: str, log_format: str = "text", model: str | None = None) -> ConsoleHandler:
    """Log INFO and above to stderr in ``log_format``; every record of this process carries
    ``process_name`` (and ``model``, for a runner)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
    handler = ConsoleHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())

    def stamp(record: logging.LogRecord) -> bool:
        if not hasattr(record, "process_name"):
            record.process_name = process_name
            if model is not None:
                record.model = model
        return True

    handler.addFilter(stamp)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)

    def log_uncaught(kind, error, traceback) -> None:  # one record, not a line a record
        logging.getLogger(process_name).critical(
            "uncaught %s: %s", kind.__name__, error, exc_info=(kind, error, traceback)
        )

    sys.excepthook = log_uncaught
    return handler


def record_from_json(line: str, model: str, pid: int, logger_name: str = "runner") -> logging.LogRecord:
    """A runner's stderr line as a record of the supervisor's log: its own time, level and message when the line
    is one of its JSON records, else the line as it is (level WARNING: tracebacks and stray output matter)."""
    entry = None
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
    if not isinstance(entry, dict) or "message" not in entry:
        record = logging.LogRecord(logger_name, logging.WARNING, "", 0, line, None, None)
    else:
        level = logging.getLevelName(str(entry.get("level", "INFO")))
        record = logging.LogRecord(
            logger_name, level if isinstance(level, int) else logging.INFO, "", 0, str(entry["message"]), None, None
        )
        try:
            record.created = datetime.fromisoformat(entry["time"]).timestamp()
            record.msecs = (record.created % 1) * 1000
        except (KeyError, TypeError, ValueError):
            pass
        if entry.get("exception"):
            record.exception = entry["exception"]
    record.process_name = "runner"
    record.model = model
    record.pid = pid
    return record
