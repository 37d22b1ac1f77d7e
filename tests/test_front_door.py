"""The supervisor's front door (supervisor/front_door.py): every stream relayed on one asyncio loop, and a
client that stops reading bounded end to end: the supervisor reads a runner's stream only as fast as the
client takes it, so what waits is the runner's (``max_pending_rounds``), which then cuts the stream off while
the others go on. Runs against the shared ``chat_supervisor`` ("pair" lets 128 rounds wait)."""

from __future__ import annotations

import json
import re
import socket
import threading

import grpc
import psutil
import pytest

from supervisor.protocol import supervisor_pb2, supervisor_pb2_grpc
from tests.processes import wait_until

PROMPT = "The for statement is used to iterate over the elements of a sequence"


def generate(sup, stub=None, **fields):
    request = supervisor_pb2.GenerateRequest(**fields)
    return (stub or sup.client.stub).Generate(request, timeout=300, metadata=sup.client.metadata)


def others_complete(sup, clients: int = 3, tokens: int = 48) -> list[int]:
    """``clients`` concurrent requests on the same model, read as they come: the tokens each got."""
    got = [0] * clients

    def client(i: int) -> None:
        chunks = list(generate(sup, model="pair", prompt=f"{PROMPT} {i}", max_tokens=tokens, ignore_eos=True))
        got[i] = chunks[-1].stats.generated_tokens

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return got


def test_a_grpc_client_that_stops_reading_is_cut_off_and_the_others_go_on(chat_supervisor):
    sup = chat_supervisor
    supervisor = psutil.Process(sup.process.pid)
    rss = supervisor.memory_info().rss
    log_mark = len(sup.stderr)
    # A client whose receive window stays at gRPC's 64 KiB (no bandwidth-delay probing; with it, gRPC's own
    # client grows its window and takes the whole answer into its memory, not the supervisor's), and large
    # chunks (20 alternatives each): the windows fill after a few hundred rounds.
    channel = grpc.insecure_channel(f"127.0.0.1:{sup.port}", options=[("grpc.http2.bdp_probe", 0)])
    slow = generate(
        sup,
        supervisor_pb2_grpc.SupervisorStub(channel),
        model="pair",
        prompt=PROMPT,
        max_tokens=4000,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=20,
        request_id="slow-grpc",
    )
    read = len(next(slow).token_ids)  # under way; then nothing is read for a while
    assert wait_until(lambda: "request slow-grpc: cancelled" in sup.stderr[log_mark:], 120), sup.stderr[-3000:]
    assert supervisor.memory_info().rss - rss < 32 * 2**20  # nothing piled up in the supervisor
    assert others_complete(sup) == [48, 48, 48]  # the cut-off row went to others
    with pytest.raises(grpc.RpcError) as raised:
        for chunk in slow:  # what was under way still comes, then the error
            read += len(chunk.token_ids)
    channel.close()
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "reads too slowly" in raised.value.details()
    assert 128 <= read < 4000


def test_an_http_client_that_stops_reading_is_cut_off_and_the_others_go_on(chat_supervisor):
    """A raw HTTP client with a small receive buffer that sends its request and reads nothing."""
    sup = chat_supervisor
    supervisor = psutil.Process(sup.process.pid)
    rss = supervisor.memory_info().rss
    log_mark = len(sup.stderr)
    body = json.dumps(
        {"model": "pair", "prompt": PROMPT, "max_tokens": 4000, "stream": True, "logprobs": 5, "ignore_eos": True}
    ).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", sup.http_port))
    try:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {sup.token}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        cut_off = re.compile(r"request http-[0-9a-f]+: cancelled")
        assert wait_until(lambda: cut_off.search(sup.stderr[log_mark:]), 120), sup.stderr[-3000:]
        assert supervisor.memory_info().rss - rss < 32 * 2**20
        assert others_complete(sup) == [48, 48, 48]
        received = b""
        client.settimeout(60)
        while b"data: [DONE]" not in received:
            data = client.recv(65536)
            if not data:
                break
            received += data
    finally:
        client.close()
    assert b" 200 OK" in received.split(b"\r\n", 1)[0]
    errors = [json.loads(line[6:]) for line in received.split(b"\n") if line.startswith(b'data: {"error"')]
    assert errors and "reads too slowly" in errors[0]["error"]["message"], received[-2000:]


def test_streams_in_flight_hold_no_thread_each(chat_supervisor):
    """Sixteen streams open at once (a full batch), half through each API: the supervisor's threads do not grow
    with them."""
    sup = chat_supervisor
    supervisor = psutil.Process(sup.process.pid)
    others_complete(sup, clients=1, tokens=4)
    threads = supervisor.num_threads()
    streams = [generate(sup, model="pair", prompt=f"{PROMPT} {i}", max_tokens=2000, ignore_eos=True) for i in range(8)]
    http = sup.openai()
    sse = [
        http.completions.create(
            model="pair", prompt=f"{PROMPT} {i}", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
        )
        for i in range(8, 16)
    ]
    try:
        for stream in streams:
            next(stream)
        for events in sse:
            next(iter(events))
        assert supervisor.num_threads() <= threads + 4
    finally:
        for stream in streams:
            stream.cancel()
        for events in sse:
            events.close()
