"""The channels the CLI, the tests and the supervisor open to a supervisor or a runner (common.client): a
refused connection is retried within a fraction of a second (a runner comes and goes), but a connection that
is slow to finish its handshake is waited for, as gRPC's default does, not given up after a quarter second.

The second is what a busy machine causes: CI's run of ``supervisor top --once`` against a supervisor relaying
a generation on both cores failed with UNAVAILABLE ("connection attempt timed out before receiving SETTINGS
frame") while grpc.min_reconnect_backoff_ms, which is also the least time gRPC gives a connection attempt,
was 20 ms. The slow handshake here comes from a stand-in: a TCP relay in front of a real gRPC server that
holds the server's first bytes back for a second, since a loaded machine cannot be caused on demand."""

from __future__ import annotations

import socket
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.client import HealthCheckedClient

HELD = 1.0  # seconds the relay holds the server's first bytes (its SETTINGS frame) back


def pipe(source: socket.socket, sink: socket.socket, hold: float) -> None:
    first = True
    try:
        while data := source.recv(65536):
            if first and hold:
                time.sleep(hold)
            first = False
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def slow_relay(target_port: int) -> int:
    """A TCP relay to 127.0.0.1:target_port whose answers start ``HELD`` seconds late; returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        while True:
            client, _ = listener.accept()
            server = socket.create_connection(("127.0.0.1", target_port))
            threading.Thread(target=pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=pipe, args=(server, client, HELD), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname()[1]


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def test_a_server_slow_to_answer_the_handshake_is_waited_for(health_server):
    with HealthCheckedClient(f"127.0.0.1:{slow_relay(health_server)}") as client:
        assert client.health_status(timeout=10) == health_pb2.HealthCheckResponse.SERVING
