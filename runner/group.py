"""A runner group: one model split across ``ranks`` processes on MLX's own distributed backend.

Tensor parallel, as mlx-lm shards a model (``model.shard(group)``): every
attention layer's heads and every MLP's hidden units are split between the
ranks, and two ``all_sum`` collectives per layer join the halves. Each rank holds
its share of the target's weights and of its KV cache; the draft model (small)
is whole on every rank.

How the ranks stay in step. Every rank runs the same engine and the same MLX
thread loop (``runner.worker``), so every forward pass, and every collective in
it, happens on every rank in the same order. What only rank 0 knows is shared
at the point where it is decided, in the order it is decided
(``Group.share``): the requests admitted at a turn (with their seeds), the ones
cancelled, whether more are waiting, the ones whose clients read too slowly, the
control tasks run (a pool release that also empties the prompt cache), the
prefill chunk sizes and joint prefill groups (sized from measured times), and
the draft depth of every round (the adaptive controller times rounds). The
rest is deterministic on every rank: the sharded model's collectives give every
rank the same logits, so the same seeded sampling gives the same tokens, the
same drafts, the same rewinds, the same prompt-cache entries and the same
releases. Rank 0 alone serves the runner's gRPC API.

Start and faults (single host): rank 0 picks a free loopback port per rank,
writes the hostfile, and starts ranks 1..N-1 as its children; they die with it
(``PR_SET_PDEATHSIG``). A rank that dies takes the group down: rank 0 exits
(``EXIT_GROUP_FAILURE``) and the supervisor restarts the runner as after any
crash, failing or resuming what was in flight. Ranks that do not all join
within ``JOIN_TIMEOUT`` fail the start with one line naming the address.

Not here: pipeline parallelism (mlx-lm has it for few architectures, none of
this project's test models) and groups across hosts.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

log = logging.getLogger("runner")

EXIT_GROUP_FAILURE = 71
JOIN_TIMEOUT = 60.0


class GroupError(RuntimeError):
    pass


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def shard_problem(folder: Path, ranks: int) -> str:
    """Why the model in ``folder`` cannot be split ``ranks`` ways by tensor parallelism ("" when it can)."""
    from mlx_lm.utils import _get_classes, load_config

    try:
        config = load_config(Path(folder))
        model_class, _ = _get_classes(config)
    except Exception as error:  # noqa: BLE001 - the load reports it properly
        return f"its config cannot be read: {error}"
    kind = config.get("model_type", "?")
    if not hasattr(model_class, "shard"):
        return f"mlx-lm cannot split a {kind} model across processes (its model has no shard())"
    heads = config.get("num_attention_heads")
    sizes = {
        "attention heads": heads,
        "key-value heads": config.get("num_key_value_heads") or heads,
        "MLP hidden units": config.get("intermediate_size"),
    }
    for what, size in sizes.items():
        if size and size % ranks:
            return f"its {size} {what} cannot be split {ranks} ways"
    return ""


class Group:
    """This process's place in a runner group, and the one way rank 0's decisions reach the others."""

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.shares = 0  # decisions shared (each one or two collectives)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _sum(self, array):
        out = mx.distributed.all_sum(array, group=self.group, stream=mx.cpu)
        mx.eval(out)
        return out

    def share_int(self, value: int | None) -> int:
        """Rank 0's ``value`` on every rank (one collective)."""
        self.shares += 1
        mine = int(value) if self.leader else 0
        return int(self._sum(mx.array([mine], dtype=mx.int64)).item())

    def gather_int(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order, on every rank."""
        out = mx.distributed.all_gather(mx.array([int(value)], dtype=mx.int64), group=self.group, stream=mx.cpu)
        return [int(v) for v in np.array(out).reshape(-1)]

    def share(self, value=None):
        """Rank 0's ``value`` (any picklable object) on every rank: its size, then its bytes. A falsy value
        (nothing admitted, nothing cancelled) costs one collective and reaches the others as None."""
        self.shares += 1
        data = pickle.dumps(value) if self.leader and value else b""
        size = int(self._sum(mx.array([len(data)], dtype=mx.int64)).item())
        if size == 0:
            return value if self.leader else None
        buffer = np.frombuffer(data, dtype=np.uint8) if self.leader else np.zeros(size, dtype=np.uint8)
        out = self._sum(mx.array(buffer))
        return value if self.leader else pickle.loads(np.array(out).tobytes())


def join(rank: int, hostfile: Path, timeout: float = JOIN_TIMEOUT) -> Group:
    """Connect this rank to the group described by ``hostfile`` (MLX's ring backend), within ``timeout``."""
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = str(hostfile)
    result: list = []

    def connect():
        try:
            result.append(mx.distributed.init(strict=True, backend="ring"))
        except Exception as error:  # noqa: BLE001 - reported below
            result.append(error)

    thread = threading.Thread(target=connect, name="group-join", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        addresses = json.loads(hostfile.read_text())
        others = ", ".join(f"rank {i} at {a[0]}" for i, a in enumerate(addresses) if i != rank)
        raise GroupError(f"the group did not form within {timeout:.0f} s: {others} did not join")
    if isinstance(result[0], Exception):
        raise GroupError(f"the group could not form: {result[0]}")
    group = Group(result[0])
    if group.size < 2:
        raise GroupError(f"the group has {group.size} rank: MLX's ring backend is not available")
    return group


class Followers:
    """Rank 0's children: ranks 1..N-1 of its group, started with its own command line, watched."""

    def __init__(self, ranks: int, argv: list[str], folder: Path, env: dict | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.hostfile = folder / f"group-{os.getpid()}.json"
        self.hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]))
        self.processes = []
        for rank in range(1, ranks):
            command = [sys.executable, "-m", "runner", *argv, "--group-rank", str(rank)]
            command += ["--group-hostfile", str(self.hostfile), "--parent-pid", str(os.getpid())]
            self.processes.append(subprocess.Popen(command, env=env))
        self._watching = False

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def watch(self, on_death) -> None:
        """Call ``on_death(rank, returncode)`` (from a thread) when a follower exits before ``stop``."""
        self._watching = True

        def run():
            while self._watching:
                for rank, process in enumerate(self.processes, 1):
                    code = process.poll()
                    if code is not None and self._watching:
                        self._watching = False
                        on_death(rank, code)
                        return
                time.sleep(0.05)

        threading.Thread(target=run, name="group-watch", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Wait for the followers to leave (rank 0 told them to stop); kill what remains."""
        self._watching = False
        deadline = time.monotonic() + timeout
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.hostfile.unlink(missing_ok=True)

    def kill(self) -> None:
        self._watching = False
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        self.hostfile.unlink(missing_ok=True)
