"""python -m runner --target DIR [--draft DIR] --listen ADDRESS [...]

One runner process: loads a model pair and serves it over gRPC (proto/runner.proto).
ADDRESS is ``unix:///path/to/socket`` (what the supervisor uses) or ``HOST:PORT``.
Exits 0 after SIGTERM, 2 when the models cannot be loaded or the address cannot
be used, 70 after an engine failure that leaves its state untrusted.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import stat
import sys
import threading
import time
from pathlib import Path

from common import logs
from common.cpu_blas import reexec_with_fast_blas
from common.logs import LOG_FORMATS
from common.settings import RunnerSettings, SettingsError

EXIT_BAD_START = 2
EXIT_ENGINE_FAILURE = 70
PR_SET_PDEATHSIG = 1


def parse_args(argv=None) -> tuple[argparse.Namespace, RunnerSettings]:
    """The process's own flags, and its settings (``common.settings``: the same names as a model's config keys)."""

    p = argparse.ArgumentParser(
        prog="python -m runner", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--listen", required=True, help="unix:///path or HOST:PORT")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (default: the parent)")
    p.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: a line a person reads; json: one JSON object per record (the supervisor reads it)",
    )
    # A runner group's ranks 1..N-1 (runner.group): started by rank 0, never by hand.
    p.add_argument("--group-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--group-hostfile", default=None, help=argparse.SUPPRESS)
    RunnerSettings.add_arguments(p)
    args = p.parse_args(argv)
    try:
        settings = RunnerSettings.from_namespace(args)
    except SettingsError as error:
        p.error(str(error))
    if settings.target is None:
        p.error("--target is required")
    return args, settings


def die_with_parent(parent_pid: int) -> None:
    """Exit when the parent dies: PR_SET_PDEATHSIG on Linux, a pid watch everywhere."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # already gone before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                logging.getLogger("runner").warning("parent %d is gone: stopping", parent_pid)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def prepare_unix_socket(address: str) -> None:
    """Socket directory only its owner can enter; a stale socket from a crash is removed."""
    path = Path(address.removeprefix("unix://"))
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = directory.stat()
    if info.st_uid != os.getuid():
        raise OSError(f"socket directory {directory} belongs to another user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(directory, 0o700)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise OSError(f"{path} exists and is not a socket")
        path.unlink()


def follow(args, settings: RunnerSettings) -> int:
    """Rank ``args.group_rank`` of a runner group: join it, load this rank's share, and take every turn rank 0
    takes until it stops (runner.group). Serves nobody; dies with rank 0 (SIGKILL: it may be blocked in a
    collective, where no handler runs)."""
    from common.errors import ModelLoadError

    from .engine import Engine
    from .group import GroupError, join
    from .worker import MlxWorker

    log = logging.getLogger("runner")
    # Stopping is rank 0's to decide: a SIGTERM to the whole process group (a supervisor's drain, a terminal's
    # Ctrl-C) reaches rank 0, which drains and then tells the others to stop. They die with it otherwise.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent_pid:
        return EXIT_BAD_START
    try:
        group = join(args.group_rank, Path(args.group_hostfile), settings.backend)
        group.mode = group.share()  # rank 0 chose tensor or pipeline
        engine = Engine.load(settings.target, settings.draft, settings, group=group)
        engine.warm_up()
    except (GroupError, ModelLoadError) as error:  # rank 0 meets the same and says it
        log.debug("rank %d: %s", args.group_rank, error)
        return EXIT_BAD_START
    failed = []
    worker = MlxWorker(
        engine,
        0,
        on_fatal=failed.append,
        name=f"{settings.name} rank {args.group_rank}",
        max_batch=settings.max_batch,
        max_pending_rounds=settings.max_pending_rounds,
        group=group,
    )
    log.info("rank %d of %d: following rank 0", group.rank, group.size)
    log.setLevel(logging.WARNING)  # rank 0 logs each request; the others' lines would repeat it
    worker._run()  # until rank 0 stops
    return EXIT_ENGINE_FAILURE if failed else 0


def start_group(settings: RunnerSettings, argv: list[str], server, log):
    """Rank 0 of a group: check the model can be split, start the other ranks, form the group, and stop the
    process as soon as any of them dies (the supervisor restarts the runner). Returns the Group and the
    Followers; raises GroupError with one line."""
    import tempfile

    from .group import EXIT_GROUP_FAILURE, Followers, GroupError, choose_parallelism, join

    mode = choose_parallelism(settings.target, settings.ranks, settings.parallelism, settings.backend)
    if settings.hostfile is not None:  # the other ranks run on their hosts, under `supervisor worker`
        log.info(
            "waiting for ranks 1..%d (%s backend, hostfile %s)", settings.ranks - 1, settings.backend, settings.hostfile
        )
        group = join(0, settings.hostfile, settings.backend, mode=mode)
        group.share(mode)
        log.info("group of %d ranks formed (%s parallel)", settings.ranks, mode)
        return group, None
    followers = Followers(settings.ranks, argv, Path(tempfile.gettempdir()) / f"mlxserve-groups-{os.getuid()}")
    try:
        group = join(0, followers.hostfile, settings.backend, mode=mode)
        group.share(mode)
    except GroupError:
        followers.kill()
        raise

    def on_death(rank: int, code: int) -> None:
        if code == 0:  # told to stop
            return
        cause = f"signal {-code}" if code < 0 else f"exit code {code}"
        log.error("rank %d of the group (pid %d) ended with %s: the group stops", rank, followers.pids[rank - 1], cause)
        followers.kill()
        os._exit(EXIT_GROUP_FAILURE)

    followers.watch(on_death)
    server.service.rank_pids = followers.pids
    log.info(
        "group of %d ranks formed (%s parallel; pids %s)", settings.ranks, mode, ", ".join(map(str, followers.pids))
    )
    return group, followers


def main(argv=None) -> int:
    reexec_with_fast_blas()
    args, settings = parse_args(argv)
    logs.setup("runner", args.log_format, model=settings.name)
    log = logging.getLogger("runner")
    die_with_parent(args.parent_pid or os.getppid())
    if args.group_rank:
        return follow(args, settings)
    from common.embedding import model_kind

    if model_kind(settings.target, settings.kind) != "generate":  # an embedding or reranking model
        from .embedding.service import serve

        return serve(args, settings, prepare_unix_socket, EXIT_BAD_START, EXIT_ENGINE_FAILURE)

    from common.errors import ModelLoadError

    from . import platform
    from .engine import Engine
    from .server import RunnerServer, RunnerService

    stopping = threading.Event()  # set by threads (engine failure)
    signalled = []  # set by signal handlers: no locks there, a handler can interrupt a lock holder
    exit_code = [0]

    def on_signal(signum, frame):
        signalled.append(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    os.umask(0o077)  # the socket file: owner only
    try:
        if args.listen.startswith("unix:"):
            prepare_unix_socket(args.listen)
        service = RunnerService(settings.name, settings.debug_rpcs)
        service.stream_interval = settings.stream_interval
        server = RunnerServer(
            service,
            args.listen,
            settings.max_queue,
            settings.stall_after,
            settings.max_batch,
            settings.max_pending_rounds,
        )
        server.start()
        if args.listen.startswith("unix:"):
            os.chmod(args.listen.removeprefix("unix://"), 0o600)
    except (OSError, RuntimeError) as error:
        print(f"runner: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return EXIT_BAD_START
    log.info("listening on %s; loading %s (draft %s)", args.listen, settings.target, settings.draft)

    started = time.perf_counter()
    group = followers = None
    if settings.ranks > 1:
        from .group import GroupError

        try:
            group, followers = start_group(settings, list(sys.argv[1:] if argv is None else argv), server, log)
        except (GroupError, OSError) as error:
            print(f"runner: {error}", file=sys.stderr)
            server.server.stop(0)
            return EXIT_BAD_START
    try:
        engine = Engine.load(settings.target, settings.draft, settings, group=group)
        engine.warm_up()
    except ModelLoadError as error:
        print(f"runner: {error}", file=sys.stderr)
        server.server.stop(0)
        if followers is not None:
            followers.kill()
        return EXIT_BAD_START

    def on_fatal(error):
        exit_code[0] = EXIT_ENGINE_FAILURE
        stopping.set()

    if signalled:
        server.shutdown(0)
        if followers is not None:
            followers.kill()
        return 0
    server.attach(engine, on_fatal)
    log.info(
        "serving %s after %.2f s: %s, %s on %s (%s), context %d; %s; release every %d tokens%s, "
        "cache limit %d; prompt cache %d bytes; batch of %d, its caches within %s",
        settings.name,
        time.perf_counter() - started,
        engine.target.config.get("model_type"),
        engine.target.compute_dtype,
        platform.describe(),
        engine.dtype_reason,
        engine.context_length,
        engine.speculative_note,
        settings.release_interval,
        "" if settings.release_enabled else " DISABLED",
        engine.cache_limit,
        engine.prompt_cache.budget,
        settings.max_batch,
        "no limit" if settings.batch_memory is None else f"{settings.batch_memory} bytes",
    )
    if not engine.speculative and (settings.drafter or "none") != "none":
        log.warning("speculative decoding is off: %s", engine.speculative_note)
    elif engine.draft is not None and engine.drafters["model"]:
        log.warning("speculative decoding with the draft model is off: %s", engine.drafters["model"])
    while not (signalled or stopping.wait(0.1)):
        pass
    log.info("stopping (grace %.1f s)", settings.grace)
    server.shutdown(settings.grace if exit_code[0] == 0 else 1.0)
    if followers is not None:  # the MLX thread told them to stop as it ended
        followers.stop()
    if args.listen.startswith("unix:"):
        Path(args.listen.removeprefix("unix://")).unlink(missing_ok=True)
    log.info("stopped")
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
