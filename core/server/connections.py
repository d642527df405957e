"""Who may hold a connection to `serve`, and what a connection that breaks HTTP is answered.

- At most `total` connections at once (TF_MAX_CONNECTIONS), and `per_client` from one client
  address (TF_MAX_CLIENT_CONNECTIONS). At a cap, the connection idle longest (silent since it
  opened, or since its last reply) is closed to make room, of that address at its own cap, as
  nginx does with keep-alive connections; when none is idle, the new connection is refused
  with 503 and Retry-After, unless its request is GET /health or GET /metrics, which is
  answered as usual on that one connection.
- A new connection that sends no byte within `first_byte_s` (TF_FIRST_BYTE_TIMEOUT_S) is closed.
- A request that breaks HTTP/1.1 (a head too large, a malformed one, TLS sent to this plain-HTTP
  port) is answered in OpenAI's error shape with Connection: close, and logged in one line.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from ..config.logs import get_logger
from .openai_api import error_body
from .openai_replies import dumps
from .request_limits import Limits

log = get_logger("tensorfold.connections")

MAX_LINE_BYTES = 8190  # a request line or one header field (aiohttp's default)
MAX_HEADERS = 128  # header fields in one request (aiohttp's default)
LISTEN_BACKLOG = 1024  # connections the kernel queues before serve accepts them
REFUSAL_WAIT_S = 1.0  # how long a refused connection may take to send its request's head
_HEAD_END = b"\r\n\r\n"
_PROBES = (b"/health", b"/metrics")


@dataclass(frozen=True)
class ConnectionCaps:
    """How many connections `serve` holds, in all and from one client address, and how soon a
    new one must start its request."""

    total: int = 1024  # TF_MAX_CONNECTIONS
    per_client: int = 256  # TF_MAX_CLIENT_CONNECTIONS
    first_byte_s: float = 5.0  # TF_FIRST_BYTE_TIMEOUT_S


def handler_args(limits: Limits) -> dict[str, Any]:
    """The arguments of every connection's aiohttp protocol: the runner's and `serve_on`'s."""
    return {
        "access_log": None,
        "max_line_size": MAX_LINE_BYTES,
        "max_field_size": MAX_LINE_BYTES,
        "max_headers": MAX_HEADERS,
        **limits.handler_args(),
    }


def refusal_bytes(message: str) -> bytes:
    """A whole 503 reply in OpenAI's error shape, closing the connection."""
    body = dumps(error_body(503, message))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def protocol_error(exc: HttpProcessingError, tls: bool) -> tuple[int, str]:
    """The status and message for a request that aiohttp's parser refused."""
    if tls:
        return 400, (
            "this port speaks plain HTTP and the client sent TLS: use an http:// URL, "
            "or put a TLS-terminating proxy in front of the server"
        )
    if isinstance(exc, LineTooLong):
        return 431, (
            f"the request line or a header field is over {MAX_LINE_BYTES} bytes, "
            "the limit; send long values in the body"
        )
    reason = exc.message.splitlines()[0].rstrip(":") if exc.message else type(exc).__name__
    if reason == "Too many headers received":
        return 431, f"the request has more than {MAX_HEADERS} header fields, the limit"
    return 400, f"the request is not valid HTTP/1.1: {reason[:200]}"


class _Handler(web.RequestHandler):
    """aiohttp's protocol for one connection, as the gate admitted it (counted against the caps)
    or handed it over past them (not counted: it serves one request, then closes)."""

    def __init__(self, gate: _Gate, client: str, counted: bool) -> None:
        super().__init__(gate.server, loop=gate.loop, **gate.handler_args)
        self.gate = gate
        self.client = client
        self.counted = counted
        self.spoke = False  # a byte has come
        self.tls = False  # the first byte began a TLS record
        self.idle_since: float | None = None  # its opening or a reply's end, silent since
        self.first_byte: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.counted:
            self.idle_since = self.gate.loop.time()
            self.first_byte = self.gate.loop.call_later(self.gate.caps.first_byte_s, self._mute)

    def _mute(self) -> None:
        self.first_byte = None
        self.force_close()

    def data_received(self, data: bytes) -> None:
        if not self.spoke and data:
            self.spoke = True
            self.tls = data[:1] == b"\x16"
            if self.first_byte is not None:
                self.first_byte.cancel()
                self.first_byte = None
        self.idle_since = None
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.first_byte is not None:
            self.first_byte.cancel()
            self.first_byte = None
        self.gate.forget(self)
        super().connection_lost(exc)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if not self.counted:
            resp.force_close()
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self.idle_since = self.gate.loop.time()

    @property
    def idle(self) -> bool:
        """Silent since the opening, or between two requests with no byte of the next one
        come: waiting as aiohttp's own keep-alive close requires (_process_keepalive)."""
        if self.idle_since is None:
            return False
        waiter = self._waiter
        return not self.spoke or (waiter is not None and not waiter.done())

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp's: too late for another reply
            raise ConnectionError("the reply had begun; no error reply can follow it")
        if isinstance(exc, HttpProcessingError):  # the client's bytes were not HTTP
            status, text = protocol_error(exc, self.tls)
            log.warning("protocol error", client=self.client, status=status, error=text)
        else:  # the server's own fault: aiohttp's log line, with its traceback
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
            text = (
                "the request's handler timed out"
                if status == 504
                else "the server failed on this request"
            )
        resp = web.Response(
            status=status,
            body=dumps(error_body(status, text)),
            content_type="application/json",
            headers={"Connection": "close"},
        )
        resp.force_close()
        return resp


class _Refusal(asyncio.Protocol):
    """A connection past a cap, kept out of the application: once its request's head has come
    (or after REFUSAL_WAIT_S), GET /health or GET /metrics is handed to a handler that answers
    it and closes; anything else is answered 503 and closed once the client has read it."""

    def __init__(self, gate: _Gate, client: str, reply: bytes) -> None:
        self.gate = gate
        self.client = client
        self.reply = reply
        self.head = b""
        self.answered = False
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.timer = self.gate.loop.call_later(REFUSAL_WAIT_S, self._answer)

    def data_received(self, data: bytes) -> None:
        if self.answered:  # the rest of a refused request: dropped
            return
        self.head += data
        if _HEAD_END in self.head or len(self.head) > MAX_LINE_BYTES * 2:
            self._answer()

    def eof_received(self) -> None:
        self._answer()  # the transport closes once the reply is written

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    def _answer(self) -> None:
        transport = self.transport
        if self.answered or transport is None or transport.is_closing():
            return
        self.answered = True
        if self.timer is not None:
            self.timer.cancel()
        if _is_probe(self.head):
            self.transport = None
            self.gate.hand_over(transport, self.client, self.head)
            return
        transport.write(self.reply)
        self.gate.refused()
        if transport.can_write_eof():  # half-closed, so that the client reads the reply
            transport.write_eof()  # before its unread request resets the connection
            self.timer = self.gate.loop.call_later(REFUSAL_WAIT_S, transport.close)
        else:
            transport.close()


def _is_probe(head: bytes) -> bool:
    """Whether the head is complete and asks GET /health or GET /metrics."""
    if _HEAD_END not in head:
        return False
    method, _, rest = head.split(b"\r\n", 1)[0].partition(b" ")
    target = rest.partition(b" ")[0].partition(b"?")[0]
    return method == b"GET" and target in _PROBES


class _Door(asyncio.Protocol):
    """A new connection's first protocol: the gate seats it at once, as a handler or a
    refusal."""

    def __init__(self, gate: _Gate) -> None:
        self.gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.gate.seat(transport)  # type: ignore[arg-type]


class _Gate:
    """The caps over the connections open: who holds them, from which address."""

    def __init__(
        self,
        server: web.Server,
        caps: ConnectionCaps,
        args: dict[str, Any],
        refused: Callable[[], None],
    ) -> None:
        self.server = server
        self.caps = caps
        self.handler_args = args
        self.refused = refused
        self.loop = asyncio.get_running_loop()
        self.open: dict[_Handler, None] = {}  # the counted handlers, oldest first
        self.clients: Counter[str] = Counter()

    def seat(self, transport: asyncio.Transport) -> None:
        client = _client(transport)
        if self.clients[client] >= self.caps.per_client and not self._make_room(client):
            self._refuse(
                transport,
                client,
                (
                    f"this client address already has {self.caps.per_client} connections open, "
                    "its limit (TF_MAX_CLIENT_CONNECTIONS); reuse them or retry later"
                ),
            )
        elif len(self.open) >= self.caps.total and not self._make_room(None):
            self._refuse(
                transport,
                client,
                (
                    f"the server already has {self.caps.total} connections open, its limit "
                    "(TF_MAX_CONNECTIONS); retry later"
                ),
            )
        else:
            handler = _Handler(self, client, counted=True)
            self.open[handler] = None
            self.clients[client] += 1
            transport.set_protocol(handler)
            handler.connection_made(transport)

    def hand_over(self, transport: asyncio.Transport, client: str, head: bytes) -> None:
        """Serve a refused connection's one request (its head already read) past the caps."""
        handler = _Handler(self, client, counted=False)
        transport.set_protocol(handler)
        handler.connection_made(transport)
        handler.data_received(head)

    def forget(self, handler: _Handler) -> None:
        if handler in self.open:
            del self.open[handler]
            self.clients[handler.client] -= 1
            if not self.clients[handler.client]:
                del self.clients[handler.client]

    def _make_room(self, client: str | None) -> bool:
        """Close the connection idle longest (of `client` when given); False when none is
        idle. A connection holding part of a pipelined request counts as idle here."""
        idle = [h for h in self.open if h.idle and (client is None or h.client == client)]
        if not idle:
            return False
        longest = min(idle, key=lambda h: h.idle_since or 0.0)
        self.forget(longest)
        longest.force_close()
        return True

    def _refuse(self, transport: asyncio.Transport, client: str, message: str) -> None:
        refusal = _Refusal(self, client, refusal_bytes(message))
        transport.set_protocol(refusal)
        refusal.connection_made(transport)


def _client(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


async def serve_on(
    runner: web.BaseRunner,
    sock: socket.socket,
    caps: ConnectionCaps,
    args: dict[str, Any],
    refused: Callable[[], None] = lambda: None,
) -> asyncio.Server:
    """Serve the runner's server on the listening socket `sock` (bound before the weights
    loaded) under `caps`, each connection's protocol made with `args` (handler_args);
    `refused` is called for each connection answered 503. The caller closes the returned
    server before runner.cleanup()."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    gate = _Gate(server, caps, args, refused)
    # asyncio listens again with its own backlog (100 unless told): a burst of connections
    # past it has its SYNs dropped, and a client's retry comes a second later
    backlog = max(LISTEN_BACKLOG, caps.total)
    return await asyncio.get_running_loop().create_server(
        lambda: _Door(gate), sock=sock, backlog=backlog
    )
