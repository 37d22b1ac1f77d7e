"""A runner group: one model split across ``ranks`` processes on MLX's own distributed backend.

Two ways to split (``parallelism``; ``choose_parallelism``). Tensor parallel, as mlx-lm shards a model
(``model.shard(group)``): every attention layer's heads and every MLP's hidden units are split between the
ranks, and two ``all_sum`` collectives per layer join the halves. Pipeline parallel (``runner.pipeline``):
each rank holds a run of the layers and hands its hidden state to the next. Either way each rank holds its
share of the target's layers and of its KV cache; the embeddings, the head and the draft model are whole on
every rank. "auto" takes tensor where the model splits evenly, else pipeline.

How the ranks stay in step. Every rank runs the same engine and the same MLX
thread loop (``runner.worker``), so every forward pass, and every collective in
it, happens on every rank in the same order. What only rank 0 knows reaches
the others as one plan at the top of each turn (``runner.worker.TurnPlan``, one
``Group.share``, one collective while small): go on, stop or idle; the control
tasks run (a pool release that also empties the prompt cache); the requests
admitted (with their seeds); the ones cancelled and the ones whose clients read
too slowly. Two decisions come from measured times
mid-turn and are shared where they are made: the prefill chunk sizes and joint
prefill groups, and the draft depth of every round. The rest is deterministic
on every rank: the collectives give every rank the same logits, so the same
seeded sampling gives the same tokens, the same drafts, the same rewinds, the
same prompt-cache entries (a pipeline's ranks count them as whole-model bytes,
``prompt_cache.layer_scaled``) and the same releases. Rank 0 alone serves the runner's gRPC API. An idle group's other
ranks wait on rank 0's ``Doorbell``, not in a collective (where the ring
backend polls a core).

Start and faults. On one host, rank 0 picks a free loopback port per rank,
writes the hostfile, and starts ranks 1..N-1 as its children; they die with it
(``PR_SET_PDEATHSIG``). Across hosts (a ``hostfile`` setting), rank 0 starts
nobody: each other rank runs under ``python -m supervisor worker`` on its host
(``supervisor.worker``), which starts it again whenever it ends. A rank that
dies takes the group down: rank 0's next collective fails, or its watch of its
children sees the death, and it exits (``EXIT_GROUP_FAILURE`` or an engine
failure); the supervisor restarts the runner as after any crash, failing or
resuming what was in flight. Ranks that do not all join within
``JOIN_TIMEOUT`` fail the start with one line naming the addresses. The
backend is MLX's ring (TCP) or, on CUDA builds, NCCL (``backend``); the
variables each reads are set here as ``mlx.launch`` sets them (NCCL's
rendezvous address resolved to an IP; each local rank its own GPU).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import secrets
import select
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
INLINE = 504  # bytes of a shared value carried by its first collective (a turn's plan fits)
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
    from .loading.architecture import architecture

    try:
        config, model_class = architecture(folder)
    except ValueError as error:
        return str(error)
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


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


class Doorbell:
    """How rank 0 wakes an idle group: one plain TCP connection to each other rank.

    A rank waiting inside a collective of MLX's ring backend polls its sockets and takes a whole core, so a
    group left waiting for rank 0's next turn would burn one core per rank while nobody asks anything. When
    rank 0 runs out of work it tells the others (a shared "idle" turn, ``runner.worker``); they then block in
    ``wait`` (a plain ``recv``: no CPU) until rank 0 ``ring``s, as its next turn begins. A busy group never
    touches these sockets. Keepalive probes end a wait whose rank 0 vanished without closing its end."""

    def __init__(self, connections: list[socket.socket]):
        self.connections = connections

    @classmethod
    def open(cls, group: Group, hostfile: Path, timeout: float = JOIN_TIMEOUT) -> Doorbell:
        """Connect rank 0 to every other rank: rank 0 listens on an ephemeral port of its hostfile address and
        shares it with a random token; each rank connects and sends the token and its rank, so a stray
        connection takes no rank's place. Any failure is a GroupError."""
        host = json.loads(Path(hostfile).read_text())[0][0].rpartition(":")[0]
        deadline = time.monotonic() + timeout
        try:
            if group.leader:
                with socket.create_server((host, 0)) as listener:
                    token = secrets.token_bytes(8)
                    group.share((listener.getsockname()[1], token))
                    connections: dict[int, socket.socket] = {}
                    while len(connections) < group.size - 1:
                        listener.settimeout(max(0.01, deadline - time.monotonic()))
                        connection, _ = listener.accept()
                        connection.settimeout(5.0)
                        try:
                            hello = _receive_exactly(connection, 9)
                        except OSError:  # a stray connection that says nothing
                            hello = b""
                        rank = hello[8] if len(hello) == 9 and hello[:8] == token else 0
                        if not 0 < rank < group.size or rank in connections:
                            connection.close()
                            continue
                        connections[rank] = connection
                connections = [connections[rank] for rank in sorted(connections)]
            else:
                port, token = group.share()
                connection = socket.create_connection((host, port), max(0.01, deadline - time.monotonic()))
                connection.sendall(token + bytes([group.rank]))
                connections = [connection]
            for connection in connections:
                connection.settimeout(None)
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
                    if hasattr(socket, option):
                        connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        except TimeoutError:
            raise GroupError(f"the other ranks did not connect to rank 0's doorbell at {host} in time") from None
        except OSError as error:
            raise GroupError(f"the group's doorbell at {host} failed: {error}") from None
        return cls(connections)

    def ring(self) -> None:
        for connection in self.connections:
            connection.sendall(b"\x01")

    def wait(self) -> None:
        if not self.connections[0].recv(1):
            raise GroupError("rank 0 closed the group")

    def check(self) -> None:
        """Rank 0, idle: raise GroupError if another rank's end has closed (it died, or its host did) - its
        collectives would fail only at the next request."""
        readable, _, _ = select.select(self.connections, [], [], 0)
        for connection in readable:
            if not connection.recv(1, socket.MSG_PEEK):
                raise GroupError(f"rank {self.connections.index(connection) + 1} left the group")


class Group:
    """This process's place in a runner group, and the one way rank 0's decisions reach the others."""

    def __init__(self, group, mode: str = "tensor"):
        self.group = group
        self.mode = mode  # "tensor" (mlx-lm's shard) or "pipeline" (runner.pipeline)
        self.rank = group.rank()
        self.size = group.size()
        self.shares = 0  # decisions shared (each one or two collectives)
        self.doorbell: Doorbell | None = None  # set by join

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
        """Rank 0's ``value`` (any picklable object) on every rank: one collective when it pickles to at most
        ``INLINE`` bytes (a turn's plan, a depth), else a second one with the rest. A falsy value reaches the
        others as None."""
        self.shares += 1
        data = pickle.dumps(value) if self.leader and value else b""
        head = np.zeros(8 + INLINE, dtype=np.uint8)
        if self.leader:
            head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
            head[8 : 8 + min(len(data), INLINE)] = np.frombuffer(data[:INLINE], dtype=np.uint8)
        head = np.array(self._sum(mx.array(head)))
        size = int.from_bytes(head[:8].tobytes(), "little")
        if size > INLINE:
            rest = np.frombuffer(data[INLINE:], dtype=np.uint8) if self.leader else np.zeros(size - INLINE, np.uint8)
            rest = np.array(self._sum(mx.array(rest)))
        if self.leader:
            return value
        if size == 0:
            return None
        data = head[8 : 8 + min(size, INLINE)].tobytes() + (rest.tobytes() if size > INLINE else b"")
        return pickle.loads(data)


def choose_parallelism(folder: Path, ranks: int, parallelism: str = "auto", backend: str = "ring") -> str:
    """ "tensor" or "pipeline" for a group of ``ranks`` serving the model in ``folder``; raises GroupError with
    the reason when the asked way (or, for "auto", neither way) can split it."""
    from .pipeline import pipeline_problem

    tensor = shard_problem(folder, ranks) if parallelism in ("auto", "tensor") else ""
    if parallelism == "tensor" or (parallelism == "auto" and not tensor):
        if tensor:
            raise GroupError(f"{folder} cannot be split across {ranks} processes by tensor parallelism: {tensor}")
        return "tensor"
    piped = pipeline_problem(folder, ranks, backend)
    if piped:
        both = f"tensor parallel: {tensor}; pipeline: {piped}" if parallelism == "auto" else piped
        raise GroupError(f"{folder} cannot be split across {ranks} processes ({both})")
    return "pipeline"


def backend_environment(rank: int, hostfile: Path, backend: str) -> dict[str, str]:
    """The variables MLX's ``backend`` reads to form a group (as ``mlx.launch`` sets them)."""
    env = {"MLX_RANK": str(rank)}
    if backend == "ring":
        env["MLX_HOSTFILE"] = str(hostfile)
    elif backend == "nccl":  # rank 0's first address is the rendezvous; NCCL takes an IP address
        hosts = json.loads(Path(hostfile).read_text())
        host, _, port = hosts[0][0].rpartition(":")
        env.update(MLX_WORLD_SIZE=str(len(hosts)), NCCL_HOST_IP=socket.gethostbyname(host), NCCL_PORT=port)
    return env


def join(
    rank: int, hostfile: Path, backend: str = "ring", timeout: float = JOIN_TIMEOUT, mode: str = "tensor"
) -> Group:
    """Connect this rank to the group described by ``hostfile`` on MLX's ``backend``, within ``timeout``."""
    if not mx.distributed.is_available(backend=backend):
        raise GroupError(f"MLX here has no {backend} backend (backend = {backend!r})")
    os.environ.update(backend_environment(rank, hostfile, backend))
    result: list = []

    def connect():
        try:
            result.append(mx.distributed.init(strict=True, backend=backend))
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
    group = Group(result[0], mode)
    if group.size < 2:
        raise GroupError(f"the group has {group.size} rank: MLX's {backend} backend is not available")
    group.doorbell = Doorbell.open(group, hostfile, timeout)
    return group


def gpu_environment(env: dict | None, devices: str, rank: int) -> dict | None:
    """A local rank's environment on a CUDA build: its own GPU (NCCL refuses two ranks on one), the
    ``rank``-th of ``CUDA_VISIBLE_DEVICES`` where it is set, else GPU ``rank``; rank 0 keeps the first. As
    ``mlx.launch`` places ranks. On other builds, the environment as it is."""
    from common.footprint import expected_backend

    if expected_backend() != "cuda":
        return env
    visible = [d for d in devices.split(",") if d] or [str(i) for i in range(rank + 1)]
    return {**(env or os.environ), "CUDA_VISIBLE_DEVICES": visible[rank % len(visible)]}


class Followers:
    """Rank 0's children: ranks 1..N-1 of its group, started with its own command line, watched."""

    def __init__(self, ranks: int, argv: list[str], folder: Path, env: dict | None = None):
        folder.mkdir(parents=True, exist_ok=True)
        self.hostfile = folder / f"group-{os.getpid()}.json"
        self.hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(ranks)]))
        self.processes = []
        devices = (env or os.environ).get("CUDA_VISIBLE_DEVICES", "")
        for rank in range(1, ranks):
            command = [sys.executable, "-m", "runner", *argv, "--group-rank", str(rank)]
            command += ["--group-hostfile", str(self.hostfile), "--parent-pid", str(os.getpid())]
            self.processes.append(subprocess.Popen(command, env=gpu_environment(env, devices, rank)))
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
