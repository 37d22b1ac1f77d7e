"""A worker host's part of a runner group across hosts: ``python -m supervisor worker``.

A model with ``ranks = N`` and a ``hostfile`` (MLX's: one list of ``host:port`` per rank) is served by rank
0, the runner the leader's supervisor starts as usual; ranks 1..N-1 run on the hosts the hostfile names, each
under this command, which reads the same TOML config, starts the rank (``python -m runner ... --group-rank
R``), and starts it again whenever it ends: a rank lives exactly as long as its group, so when the leader's
runner dies or restarts (a crash, a drain, a new config), the rank's next collective fails, it exits, and the
fresh one joins the leader's next group. Nothing here serves clients; the leader's supervisor does, and its
health says whether the group is up.

The rank dies with this process (``PR_SET_PDEATHSIG``); SIGTERM or SIGINT stops it and returns. The rank is
taken from ``--rank`` or, under a Kubernetes LeaderWorkerSet, from ``LWS_WORKER_INDEX``; ``LWS_GROUP_SIZE``,
when set, must equal ``ranks``. ``lws_hostfile`` writes the hostfile a LeaderWorkerSet's pods share, from the
leader address the set gives every pod (its workers' names follow from it).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .config import ConfigError, SupervisorConfig
from .runners import runner_environment

log = logging.getLogger("supervisor")

RESTART_PAUSE = 1.0  # seconds between a rank's end and its next start (it waits for the leader to join anyway)


class WorkerError(ValueError):
    pass


def lws_hostfile(environment: dict[str, str], port: int) -> list[list[str]]:
    """The hostfile of a LeaderWorkerSet's group: ``LWS_LEADER_ADDRESS`` is the leader pod's DNS name
    (``<set>-<group>.<service>.<namespace>``), worker ``i``'s is ``<set>-<group>-<i>.<service>.<namespace>``;
    ``LWS_GROUP_SIZE`` ranks, each on ``port``."""
    try:
        leader = environment["LWS_LEADER_ADDRESS"]
        size = int(environment["LWS_GROUP_SIZE"])
    except (KeyError, ValueError) as error:
        raise WorkerError(f"not in a LeaderWorkerSet pod: {error} is missing or not a number") from None
    pod, dot, domain = leader.partition(".")
    return [[f"{leader}:{port}"]] + [[f"{pod}-{i}{dot}{domain}:{port}"] for i in range(1, size)]


def worker_rank(model, rank: int | None, environment: dict[str, str]) -> int:
    """This host's rank of ``model``'s group, checked against its settings."""
    settings = model.runner
    if settings.ranks < 2 or settings.hostfile is None:
        raise ConfigError(
            f"models.{model.name}.hostfile", "a worker serves a group across hosts: set ranks and hostfile"
        )
    if rank is None and "LWS_WORKER_INDEX" in environment:
        rank = int(environment["LWS_WORKER_INDEX"])
    if rank is None:
        raise WorkerError("which rank: pass --rank (or run under a LeaderWorkerSet, which sets LWS_WORKER_INDEX)")
    if not 1 <= rank < settings.ranks:
        raise WorkerError(
            f"rank {rank} is not one of a worker's ranks, 1..{settings.ranks - 1} (rank 0 is the leader's)"
        )
    size = environment.get("LWS_GROUP_SIZE")
    if size is not None and int(size) != settings.ranks:
        raise ConfigError(f"models.{model.name}.ranks", f"is {settings.ranks}, the LeaderWorkerSet's size {size}")
    return rank


class RankKeeper:
    """Runs rank ``rank`` of ``model``'s group, again each time it ends, until ``stop``."""

    def __init__(self, config: SupervisorConfig, model, rank: int):
        self.config, self.model, self.rank = config, model, rank
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self._stopping = threading.Event()
        self._starting = threading.Lock()

    def command(self) -> list[str]:
        settings = self.model.runner
        listen = f"unix://{self.config.runtime_dir}/{self.model.name}-rank{self.rank}.sock"  # never opened
        return [
            sys.executable,
            "-m",
            "runner",
            "--listen",
            listen,
            "--parent-pid",
            str(os.getpid()),
            "--log-format",
            self.config.log_format,
            *settings.to_argv(),
            "--group-rank",
            str(self.rank),
            "--group-hostfile",
            str(settings.hostfile),
        ]

    def run(self) -> None:
        while True:
            with self._starting:  # stop() either sees this process or ends the loop before it starts
                if self._stopping.is_set():
                    break
                self.starts += 1
                self.process = subprocess.Popen(
                    self.command(), stdin=subprocess.DEVNULL, env=runner_environment(self.config)
                )
            log.info("%s: rank %d started (pid %d), joining the group", self.model.name, self.rank, self.process.pid)
            code = self.process.wait()
            if self._stopping.is_set():
                break
            log.warning(
                "%s: rank %d (pid %d) ended with %s; starting it again",
                self.model.name,
                self.rank,
                self.process.pid,
                code,
            )
            self._stopping.wait(RESTART_PAUSE)

    def stop(self) -> None:
        with self._starting:
            self._stopping.set()
            process = self.process
        if process is not None and process.poll() is None:
            process.kill()  # a rank ignores SIGTERM (rank 0 decides when a group stops); it holds no state of its own
            process.wait()


def write_lws_hostfile(args) -> int:
    """``python -m supervisor lws-hostfile OUT --port P``: the group's hostfile in a LeaderWorkerSet pod."""
    try:
        hosts = lws_hostfile(dict(os.environ), args.port)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(hosts))
    except (WorkerError, OSError) as error:
        print(f"supervisor: {error}", file=sys.stderr)
        return 2
    return 0


def main(args) -> int:
    """``python -m supervisor worker --model NAME [--rank R]``: keep this host's rank of the model's group."""
    from common import logs

    from .config import default_config, load

    try:
        config = load(args.config) if args.config else default_config()
        if args.model not in config.models:
            raise ConfigError("--model", f"{args.model!r} is not one of {', '.join(config.models)}")
        model = config.models[args.model]
        rank = worker_rank(model, args.rank, dict(os.environ))
    except (ConfigError, WorkerError, ValueError) as error:
        print(f"supervisor: {error}", file=sys.stderr)
        return 2
    logs.setup("supervisor", config.log_format)
    config.runtime_dir.mkdir(parents=True, exist_ok=True)
    keeper = RankKeeper(config, model, rank)
    signal.signal(signal.SIGTERM, lambda signum, frame: threading.Thread(target=keeper.stop).start())
    signal.signal(signal.SIGINT, lambda signum, frame: threading.Thread(target=keeper.stop).start())
    log.info("worker for %s: rank %d of %d, hostfile %s", model.name, rank, model.runner.ranks, model.runner.hostfile)
    keeper.run()
    log.info("worker for %s: stopped", model.name)
    return 0
