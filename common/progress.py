"""Progress on long work, shown on a terminal only (rich): a bar for work counted in bytes (a GGUF import's
tensors), a spinner while waiting (a stage of an import, a long prompt prefilling in the terminal chat).

Both draw on ``file`` (stderr by default) when it is a terminal and clear themselves when done (transient), so
what stays on the screen is the work's own output. On anything else (a pipe, a log file, systemd's journal, a
test's capture) they print nothing at all: a log gets one line per event, never a redrawn bar.
"""

from __future__ import annotations

import contextlib
import sys


def _console(file):
    from rich.console import Console

    return Console(file=file if file is not None else sys.stderr)


def _bytes_progress(console):
    """A rich Progress with bytes done, the rate and the time left."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    return Progress(*columns, TimeRemainingColumn(), console=console, transient=True)


@contextlib.contextmanager
def byte_bar(description: str, total: int, file=None):
    """Yields ``advance(nbytes)``; a bar with bytes done, the rate and the time left, while the block runs."""
    console = _console(file)
    if not console.is_terminal:
        yield lambda done: None
        return
    with _bytes_progress(console) as progress:
        task = progress.add_task(description, total=total)
        yield lambda done: progress.advance(task, done)


@contextlib.contextmanager
def spinner(message: str, file=None):
    """A spinner with ``message`` while the block runs; yields ``update(message)`` to change what it says."""
    console = _console(file)
    if not console.is_terminal:
        yield lambda message: None
        return
    with console.status(message) as status:
        yield lambda message: status.update(message)


@contextlib.contextmanager
def growing_bar(description: str, file=None):
    """Yields ``show(done, total)``: a bar with bytes done, the rate and the time left, whose total may grow as
    work is found (a pull's files). Nothing off a terminal."""
    console = _console(file)
    if not console.is_terminal:
        yield lambda done, total: None
        return
    with _bytes_progress(console) as progress:
        task = progress.add_task(description, total=None)
        yield lambda done, total: progress.update(task, completed=done, total=total or None)
