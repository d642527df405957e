"""Fair connections and protocol errors, against a real `tensorfold serve` with small caps: one
client address at its cap does not stop another, idle and silent connections give way at a cap,
/health and /metrics answer while the connection budget is full, a silent new connection is
closed after the first-byte timeout, and each protocol error gets OpenAI's error shape and one
log line. Client sockets bind source addresses in 127.0.0.0/8 to act as several clients."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
from test_server import ServedDemo, served
from test_server_limits import HELD_BODY, address, good, hold, read_message, read_reply

MAX_CONNECTIONS = 6
MAX_CLIENT_CONNECTIONS = 3
FIRST_BYTE_TIMEOUT_S = 1
READ_TIMEOUT_S = 20  # long beside the first-byte timeout: held connections outlive each test


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(
        tmp_path_factory,
        "connections",
        "--parallel",
        "1",
        env={
            "TF_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
            "TF_MAX_CLIENT_CONNECTIONS": str(MAX_CLIENT_CONNECTIONS),
            "TF_FIRST_BYTE_TIMEOUT_S": str(FIRST_BYTE_TIMEOUT_S),
            "TF_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        },
    )


def connect(server: ServedDemo, client: str = "127.0.0.1") -> socket.socket:
    """A connection from the client address `client` (any address of 127.0.0.0/8)."""
    sock = socket.create_connection(address(server), timeout=30, source_address=(client, 0))
    sock.settimeout(30)
    return sock


def exchange(sock: socket.socket, request: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """Send `request` (or nothing more) and read one reply, leaving the connection open: its
    status line, its head and its body."""
    if request:
        sock.sendall(request)
    return read_message(sock)


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()


def refusal(reply: bytes, setting: str) -> None:
    """`reply` is a whole 503 in OpenAI's shape, naming `setting`, with Retry-After."""
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 503"), reply[:300]
    assert b"\r\nRetry-After: 1" in head and b"\r\nConnection: close" in head
    error = json.loads(body)["error"]
    assert setting in error["message"] and error["type"] == "service_unavailable_error"


def is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (which it was not to answer)."""
    try:
        return read_reply(sock) == b""
    except ConnectionResetError:
        return True


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()


def test_one_address_at_its_cap_does_not_stop_another(server: ServedDemo) -> None:
    busy = [connect(server, "127.0.0.2") for _ in range(MAX_CLIENT_CONNECTIONS)]
    try:
        for sock in busy:  # each inside a request: none idle, none closed for room
            hold(sock)
        extra = connect(server, "127.0.0.2")
        extra.sendall(get("/v1/models"))
        reply = read_reply(extra)
        extra.close()
        refusal(reply, "TF_MAX_CLIENT_CONNECTIONS")
        other = connect(server, "127.0.0.1")
        assert exchange(other, get("/v1/models"))[0] == b"HTTP/1.1 200 OK"
        other.close()
        good(server)
        for sock in busy:  # the address's own connections go on
            assert exchange(sock, HELD_BODY)[0] == b"HTTP/1.1 200 OK"
    finally:
        close_all(busy)


def test_idle_connections_give_way_at_the_cap(server: ServedDemo) -> None:
    held = [connect(server, f"127.0.0.{2 + i % 2}") for i in range(MAX_CONNECTIONS)]
    try:
        for sock in held:  # each answered, then idle between requests: the budget is full
            assert exchange(sock, get("/health"))[0] == b"HTTP/1.1 200 OK"
        newcomer = connect(server, "127.0.0.1")
        assert exchange(newcomer, get("/v1/models"))[0] == b"HTTP/1.1 200 OK"
        newcomer.close()
        assert is_closed(held[0])  # idle longest: closed to make room
        for sock in held[1:]:
            assert exchange(sock, get("/health"))[0] == b"HTTP/1.1 200 OK"
        # At its own cap, an address's idle connection gives way to its next one.
        own = connect(server, "127.0.0.3")
        assert exchange(own, get("/health"))[0] == b"HTTP/1.1 200 OK"
        own.close()
        assert is_closed(held[1])  # 127.0.0.3's idle longest
    finally:
        close_all(held)
    good(server)


def test_silent_connections_give_way_at_the_cap(server: ServedDemo) -> None:
    silent = [connect(server, f"127.0.0.{2 + i % 2}") for i in range(MAX_CONNECTIONS)]
    try:
        newcomer = connect(server, "127.0.0.1")
        assert exchange(newcomer, get("/v1/models"))[0] == b"HTTP/1.1 200 OK"
        newcomer.close()
        assert is_closed(silent[0])  # silent longest: closed to make room
    finally:
        close_all(silent)
    good(server)


def test_health_and_metrics_answer_while_the_budget_is_full(server: ServedDemo) -> None:
    busy = [connect(server, f"127.0.0.{2 + i % 2}") for i in range(MAX_CONNECTIONS)]
    try:
        for sock in busy:
            hold(sock)
        refused = connect(server)
        refused.sendall(get("/v1/models"))
        refusal(read_reply(refused), "TF_MAX_CONNECTIONS")
        refused.close()
        for path in ("/health", "/metrics", "/metrics?x=1"):
            probe = connect(server)
            status, head, body = exchange(probe, get(path))
            assert status == b"HTTP/1.1 200 OK", (path, body[:300])
            assert b"\r\nConnection: close" in head  # one request, past the cap
            assert is_closed(probe)
            probe.close()
        assert b"tensorfold_http_errors_total" in body
        for sock in busy:
            assert exchange(sock, HELD_BODY)[0] == b"HTTP/1.1 200 OK"
    finally:
        close_all(busy)
    good(server)


def test_a_silent_connection_is_closed_after_the_first_byte_timeout(server: ServedDemo) -> None:
    silent = connect(server)
    started = connect(server)
    started.sendall(b"G")  # one byte in time: its request may take TF_READ_TIMEOUT_S
    try:
        assert is_closed(silent)
        assert exchange(started, b"ET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == (
            b"HTTP/1.1 200 OK"
        )
    finally:
        silent.close()
        started.close()


TLS_HELLO = bytes.fromhex("1603010200010002000303") + bytes(64)
PROTOCOL_ERRORS = {
    "header_over_8_kb": (
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        431,
        "8190 bytes",
    ),
    "1000_headers": (
        b"GET /health HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-%d: a\r\n" % i for i in range(1000))
        + b"\r\n",
        431,
        "128 header fields",
    ),
    "length_and_chunked": (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
        "Content-Length",
    ),
    "tls_to_plain_http": (TLS_HELLO, 400, "http://"),
    "not_http": (b"HELLO\r\n\r\n", 400, "not valid HTTP/1.1"),
}


@pytest.mark.parametrize("case", PROTOCOL_ERRORS)
def test_a_protocol_error_is_a_json_error_and_one_log_line(server: ServedDemo, case: str) -> None:
    request, status, says = PROTOCOL_ERRORS[case]
    logged = server.logs()
    sock = connect(server)
    sock.sendall(request)
    reply = read_reply(sock)
    sock.close()
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.split(b" ")[1] == str(status).encode(), reply[:300]
    assert b"\r\nConnection: close" in head and b"application/json" in head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and says in error["message"], error
    new = server.logs()[len(logged) :].splitlines()
    assert len(new) == 1 and "protocol error" in new[0] and str(status) in new[0], new
    good(server)
