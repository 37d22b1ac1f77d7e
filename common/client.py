"""A small client for one runner: channel, stubs, readiness and a generate helper."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .defaults import CHANNEL_OPTIONS
from .protocol import runner_pb2, runner_pb2_grpc

# A runner is a local child that comes and goes: retry a refused socket quickly
# (gRPC floors these at 100 ms) instead of its default backoff of a second and
# more. grpc.min_reconnect_backoff_ms is left at its default: gRPC takes it as the
# least time a connection attempt gets to finish its handshake (20 s), and at
# 20 ms a busy server's handshake never finished in time (tests/test_channels.py).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.max_reconnect_backoff_ms", 250),
]


class HealthCheckedClient:
    """A channel with the standard health service: the part runner and supervisor clients share."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def health_status(self, service: str = "", timeout: float = 1.0) -> int | None:
        """HealthCheckResponse status, or None when the server does not answer."""
        try:
            return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        except grpc.RpcError:
            return None

    def wait_serving(self, timeout: float, service: str = "", alive=lambda: True) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive():
            if self.health_status(service, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return True
            time.sleep(0.05)
        return False


class RunnerClient(HealthCheckedClient):
    def __init__(self, address: str):
        super().__init__(address)
        self.stub = runner_pb2_grpc.RunnerStub(self.channel)

    def generate(self, timeout: float | None = None, **fields):
        """Stream GenerateChunks for a request built from keyword fields."""
        return self.stub.Generate(runner_pb2.GenerateRequest(**fields), timeout=timeout)
