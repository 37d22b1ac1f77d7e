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

from common.cpu_blas import reexec_with_fast_blas

EXIT_BAD_START = 2
EXIT_ENGINE_FAILURE = 70
PR_SET_PDEATHSIG = 1


def parse_args(argv=None) -> argparse.Namespace:
    from common.defaults import (DEFAULT_GRACE, DEFAULT_MAX_BATCH, DEFAULT_MAX_DRAFT_TOKENS, DEFAULT_MAX_QUEUE, DEFAULT_NGRAM_MAX,
                           DEFAULT_NGRAM_MIN, DEFAULT_PREFILL_CHUNK, DEFAULT_RELEASE_INTERVAL, DEFAULT_STALL_AFTER,
                           DTYPES, MAX_NUM_DRAFT_TOKENS)

    p = argparse.ArgumentParser(prog="python -m runner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, type=Path, help="target model folder (mlx-lm layout)")
    p.add_argument("--draft", type=Path, help="draft model folder; omit for plain decoding")
    p.add_argument("--listen", required=True, help="unix:///path or HOST:PORT")
    p.add_argument("--name", default="default", help="model name, for logs and Info")
    p.add_argument("--num-draft-tokens", default="auto",
                   help="auto: choose the depth round by round (runner/depth.py); a number pins it")
    p.add_argument("--max-draft-tokens", type=int, default=DEFAULT_MAX_DRAFT_TOKENS,
                   help="the deepest round the adaptive depth tries")
    p.add_argument("--drafter", choices=("model", "ngram", "none"), default=None,
                   help="what drafts: the draft model, n-gram lookup in the context, or nothing "
                        "(default: model when --draft is given, else ngram)")
    p.add_argument("--ngram-max", type=int, default=DEFAULT_NGRAM_MAX, help="longest suffix n-gram lookup matches")
    p.add_argument("--ngram-min", type=int, default=DEFAULT_NGRAM_MIN, help="shortest suffix n-gram lookup matches")
    p.add_argument("--release-interval", type=int, default=DEFAULT_RELEASE_INTERVAL)
    p.add_argument("--cache-limit", default="default", help='"default", "unbounded" or bytes')
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: the checkpoint's form on a GPU, float32 on the CPU (if it fits); "
                        "checkpoint: as stored (quantized stays quantized); float32: dequantize and cast")
    p.add_argument("--max-context", type=int, default=None, help="lower the model's context length to this")
    p.add_argument("--prompt-cache", type=int, default=None,
                   help="bytes the prompt cache may hold (0 = off; default: an eighth of memory, at most 4 GiB)")
    p.add_argument("--batch-memory", type=int, default=None,
                   help="bytes the batched requests' caches may take, projected to their ends; a request that "
                        "would pass it waits (runner/batch_memory.py; default: no limit)")
    p.add_argument("--no-malloc-trim", action="store_true",
                   help="do not give freed heap memory back to the system after pool releases")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for a place in the batch; the next one is refused")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="requests decoded together at most (1 = one at a time)")
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE, help="seconds in-flight work gets after SIGTERM")
    p.add_argument("--stall-after", type=float, default=DEFAULT_STALL_AFTER,
                   help="health turns NOT_SERVING when the MLX thread makes no progress for this long; "
                        "prefill chunks are sized to take a quarter of it at most")
    p.add_argument("--no-release", action="store_true", help="debug: never release the pool (shows the leak)")
    p.add_argument("--debug-rpcs", action="store_true", help="debug: enable DebugBlock")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (default: the parent)")
    args = p.parse_args(argv)
    if args.cache_limit not in ("default", "unbounded"):
        try:
            args.cache_limit = int(args.cache_limit)
        except ValueError:
            p.error("--cache-limit must be default, unbounded or a number of bytes")
    if args.num_draft_tokens == "auto":
        args.num_draft_tokens = None
    else:
        try:
            args.num_draft_tokens = int(args.num_draft_tokens)
        except ValueError:
            p.error("--num-draft-tokens must be auto or a number")
        if not 0 <= args.num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
            p.error(f"--num-draft-tokens must lie in [0, {MAX_NUM_DRAFT_TOKENS}]")
    if not 1 <= args.max_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
        p.error(f"--max-draft-tokens must lie in [1, {MAX_NUM_DRAFT_TOKENS}]")
    if not 1 <= args.ngram_min <= args.ngram_max:
        p.error("--ngram-min must be at least 1 and at most --ngram-max")
    if args.max_batch < 1:
        p.error("--max-batch must be at least 1")
    if args.release_interval <= 0 or args.max_queue < 0 or args.prefill_chunk <= 0:
        p.error("--release-interval and --prefill-chunk must be positive, --max-queue >= 0")
    if args.max_context is not None and args.max_context < 2:
        p.error("--max-context must be at least 2")
    if args.prompt_cache is not None and args.prompt_cache < 0:
        p.error("--prompt-cache must be >= 0")
    if args.batch_memory is not None and args.batch_memory <= 0:
        p.error("--batch-memory must be positive")
    if args.stall_after <= 0:
        p.error("--stall-after must be positive")
    return args


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


def main(argv=None) -> int:
    reexec_with_fast_blas()
    args = parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s runner[{args.name}:%(process)d] %(levelname)s %(message)s")
    log = logging.getLogger("runner")
    die_with_parent(args.parent_pid or os.getppid())

    from .engine import Engine, EngineSettings
    from common.errors import ModelLoadError
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
        server = RunnerServer(RunnerService(args.name, args.debug_rpcs), args.listen, args.max_queue,
                              args.stall_after, args.max_batch)
        server.start()
        if args.listen.startswith("unix:"):
            os.chmod(args.listen.removeprefix("unix://"), 0o600)
    except (OSError, RuntimeError) as error:
        print(f"runner: cannot listen on {args.listen}: {error}", file=sys.stderr)
        return EXIT_BAD_START
    log.info("listening on %s; loading %s (draft %s)", args.listen, args.target, args.draft)

    settings = EngineSettings(
        num_draft_tokens=args.num_draft_tokens, release_interval=args.release_interval,
        prefill_chunk=args.prefill_chunk, cache_limit=args.cache_limit, release_enabled=not args.no_release,
        dtype=args.dtype, max_context=args.max_context, prefill_seconds=args.stall_after / 4,
        prompt_cache_bytes=args.prompt_cache, malloc_trim=not args.no_malloc_trim,
        max_draft_tokens=args.max_draft_tokens, drafter=args.drafter or "", ngram_max=args.ngram_max,
        ngram_min=args.ngram_min, batch_memory=args.batch_memory,
    )
    started = time.perf_counter()
    try:
        engine = Engine.load(args.target, args.draft, settings)
        engine.warm_up()
    except ModelLoadError as error:
        print(f"runner: {error}", file=sys.stderr)
        server.server.stop(0)
        return EXIT_BAD_START

    def on_fatal(error):
        exit_code[0] = EXIT_ENGINE_FAILURE
        stopping.set()

    if signalled:
        server.shutdown(0)
        return 0
    server.attach(engine, on_fatal)
    log.info("serving %s after %.2f s: %s, %s on the %s (%s), context %d; %s; release every %d tokens%s, "
             "cache limit %d; prompt cache %d bytes; batch of %d, its caches within %s", args.name,
             time.perf_counter() - started,
             engine.target.config.get("model_type"), engine.target.compute_dtype, engine.device, engine.dtype_reason,
             engine.context_length, engine.speculative_note, settings.release_interval,
             "" if settings.release_enabled else " DISABLED", engine.cache_limit, engine.prompt_cache.budget,
             args.max_batch, "no limit" if args.batch_memory is None else f"{args.batch_memory} bytes")
    if not engine.speculative and (args.drafter or "none") != "none":
        log.warning("speculative decoding is off: %s", engine.speculative_note)
    elif engine.draft is not None and engine.drafters["model"]:
        log.warning("speculative decoding with the draft model is off: %s", engine.drafters["model"])
    while not (signalled or stopping.wait(0.1)):
        pass
    log.info("stopping (grace %.1f s)", args.grace)
    server.shutdown(args.grace if exit_code[0] == 0 else 1.0)
    if args.listen.startswith("unix:"):
        Path(args.listen.removeprefix("unix://")).unlink(missing_ok=True)
    log.info("stopped")
    return exit_code[0]


if __name__ == "__main__":
    sys.exit(main())
