"""What one client may cost the server: the default body limit (a 10 MB body is refused while
/health keeps answering), slow clients (headers or a body that never finish), and the cap on
open connections. Each case ends with a good request and an even census."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from test_server import ServedDemo, served

READ_TIMEOUT_S = 2
MAX_CONNECTIONS = 6
BOUND_S = 2.0  # a generous bound for a /health answer on a loaded machine (about 1 ms unloaded)
COMPLETION = {"prompt": "The little", "max_tokens": 3}
HELD_BODY = json.dumps({"model": "lfm2_moe-demo", **COMPLETION}).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(
        tmp_path_factory,
        "limits",
        "--parallel",
        "1",
        env={"TF_READ_TIMEOUT_S": str(READ_TIMEOUT_S), "TF_MAX_CONNECTIONS": str(MAX_CONNECTIONS)},
    )


def address(server: ServedDemo) -> tuple[str, int]:
    url = urlsplit(server.base)
    return url.hostname or "127.0.0.1", url.port or 80


def health_s(server: ServedDemo) -> float:
    start = time.monotonic()
    with urllib.request.urlopen(server.base + "/health", timeout=30) as r:
        assert r.status == 200
    return time.monotonic() - start


def good(server: ServedDemo) -> None:
    with server.client() as client:  # closed: its connection does not stay open
        r = client.completions.create(model="lfm2_moe-demo", **COMPLETION)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    server.wait_even()


def read_reply(sock: socket.socket, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def health_on(
    sock: socket.socket, send: bytes = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
) -> bytes:
    """Send `send` (GET /health) on an open connection and read one reply, keeping the
    connection open; the reply's status line."""
    sock.sendall(send)
    sock.settimeout(30)
    return read_message(sock)[0]


def read_message(sock: socket.socket) -> tuple[bytes, bytes, bytes]:
    """Read one reply (its head, then Content-Length bytes of body), leaving the connection
    open: its status line, its head and its body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(
        next(
            line.split(b":")[1]
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the connection closed mid-body"
        body += chunk
    return head.split(b"\r\n")[0], head, body


def hold(sock: socket.socket) -> None:
    """Start a request on `sock` and leave it waiting for its body (HELD_BODY): once the server
    has answered 100 Continue, it holds the connection busy, not idle."""
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(HELD_BODY)
    )
    sock.settimeout(30)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed after {data!r}"
        data += chunk
    assert data == b"HTTP/1.1 100 Continue\r\n\r\n", data


def test_a_10_mb_body_is_refused_while_health_answers(server: ServedDemo) -> None:
    size = 10 * 1000 * 1000  # over the default 8 MiB
    sock = socket.create_connection(address(server))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n" % size
    )
    sent = threading.Event()

    def send() -> None:
        chunk = b" " * 65536
        try:
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)
                time.sleep(0.001)
        except OSError:  # the server may stop reading once it has answered
            pass
        sent.set()

    sender = threading.Thread(target=send)
    sender.start()
    slowest = 0.0
    while not sent.is_set():
        slowest = max(slowest, health_s(server))
    sender.join()
    reply = read_reply(sock)
    sock.close()
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"\r\nConnection: close\r\n" in reply.split(b"\r\n\r\n")[0] + b"\r\n"
    error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert "8 MiB" in error["message"] and "TF_MAX_BODY_MIB" in error["message"]
    assert slowest < BOUND_S
    good(server)


def test_a_body_shorter_than_its_length_gets_408_and_the_connection_closes(
    server: ServedDemo,
) -> None:
    sock = socket.create_connection(address(server))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        b'\r\nContent-Length: 100\r\n\r\n{"prompt": '
    )
    start = time.monotonic()
    reply = read_reply(sock)  # returns once the server has closed the connection
    took = time.monotonic() - start
    sock.close()
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"TF_READ_TIMEOUT_S" in reply
    assert READ_TIMEOUT_S - 0.5 < took < 25
    good(server)


def test_headers_that_never_end_are_cut(server: ServedDemo) -> None:
    sock = socket.create_connection(address(server))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    start = time.monotonic()
    assert read_reply(sock) == b""  # closed, with nothing to answer
    assert time.monotonic() - start < 25
    sock.close()
    good(server)


def test_connections_past_the_cap_get_503_and_others_go_on(server: ServedDemo) -> None:
    time.sleep(READ_TIMEOUT_S + 0.5)  # idle connections of earlier tests are closed by then
    refused = server.metrics().get("tensorfold_http_errors_total{status=503}", 0)
    held = [socket.create_connection(address(server)) for _ in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each inside a request: none idle, none closed for room
            hold(sock)
        extra = socket.create_connection(address(server))
        extra.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        reply = read_reply(extra)
        extra.close()
        assert reply.startswith(b"HTTP/1.1 503"), reply[:300]
        assert b"Retry-After: 1" in reply and b"TF_MAX_CONNECTIONS" in reply
        for sock in held:  # the connections held still work
            assert health_on(sock, HELD_BODY) == b"HTTP/1.1 200 OK"
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.2)  # the server notices the closes
    good(server)
    assert server.metrics()["tensorfold_http_errors_total{status=503}"] >= refused + 1
