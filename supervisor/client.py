"""A client for the supervisor's public API, used by the CLI, the tests and the benchmarks."""

from __future__ import annotations

from common.client import HealthCheckedClient

from .protocol import supervisor_pb2, supervisor_pb2_grpc

STATE_NAMES = {v: k.removeprefix("RUNNER_STATE_").lower() for k, v in supervisor_pb2.RunnerState.items()}


class SupervisorClient(HealthCheckedClient):
    def __init__(self, address: str, token: str = ""):
        super().__init__(address)
        self.stub = supervisor_pb2_grpc.SupervisorStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(self, timeout: float | None = None, **fields):
        return self.stub.Generate(supervisor_pb2.GenerateRequest(**fields), timeout=timeout, metadata=self.metadata)

    def list_models(self):
        return self.stub.ListModels(supervisor_pb2.ListModelsRequest(), timeout=10, metadata=self.metadata)

    def load_model(self, model: str, timeout: float = 180):
        return self.stub.LoadModel(
            supervisor_pb2.LoadModelRequest(model=model), timeout=timeout, metadata=self.metadata
        )

    def unload_model(self, model: str, timeout: float = 60):
        return self.stub.UnloadModel(
            supervisor_pb2.UnloadModelRequest(model=model), timeout=timeout, metadata=self.metadata
        )

    def get_memory(self, model: str = ""):
        return self.stub.GetMemory(supervisor_pb2.GetMemoryRequest(model=model), timeout=10, metadata=self.metadata)

    def get_status(self):
        return self.stub.GetStatus(supervisor_pb2.GetStatusRequest(), timeout=10, metadata=self.metadata)

    def pull(self, model: str, timeout: float | None = None):
        """A hub repository's pull: its PullProgress records as they come."""
        return self.stub.Pull(supervisor_pb2.PullRequest(model=model), timeout=timeout, metadata=self.metadata)

    def model(self, name: str):
        return next(m for m in self.list_models().models if m.name == name)


def loading_line(model) -> str:
    """How far a starting model's load has got: its seconds so far, against its last load's."""
    line = f"loading {model.name}: {model.loading_s:.1f} s"
    if model.last_load_s:
        line += f" (the last load took {model.last_load_s:.1f} s)"
    return line


def format_models(models, memory: bool = False) -> str:
    lines = []
    for m in models:
        line = f"{m.name:<16} {STATE_NAMES[m.state]:<9} pid {m.pid:<7} restarts {m.restarts:<3} {m.reason}"
        if m.state == supervisor_pb2.RUNNER_STATE_STARTING:
            line += f" ({loading_line(m)})"
        if m.making_room_for:
            line += f" (making room for {m.making_room_for}: new requests wait)"
        if memory:
            s = m.memory
            line += (
                f"\n    rss {s.rss / 2**20:.0f} MiB, anonymous {s.anonymous / 2**20:.0f} MiB, "
                f"peak {s.peak_rss / 2**20:.0f} MiB "
                f"(estimate {s.estimate / 2**20:.0f} MiB), "
                f"growth {s.growth_bytes_per_s / 2**20:+.1f} MiB/s; MLX active {s.mlx_active / 2**20:.0f} MiB, "
                f"pool {s.mlx_cache / 2**20:.1f} MiB, releases {s.mlx_releases}; prompt cache "
                f"{s.prompt_cache.entries} entries, {s.prompt_cache.bytes / 2**20:.1f} of "
                f"{s.prompt_cache.budget / 2**20:.0f} MiB, {s.prompt_cache.hits} hits"
            )
        lines.append(line)
    return "\n".join(lines)
