"""The access log: one info line a request, at its end (a stream's too, once it is over), with
its method, route, status, duration and, for a generation, its prompt, completion and cached
tokens and the time to its first token. Off with --no-access-log (TF_ACCESS_LOG=0).

Every route is logged, except GET /health and GET /metrics when they answer 2xx: probes and
scrapers poll them every few seconds, and their lines would bury the requests; a failing probe
is still logged. A request whose client left before the answer is logged with status 499.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from aiohttp import web

from ..config.logs import get_logger

log = get_logger("tensorfold.access")

QUIET = ("/health", "/metrics")  # polled: logged only when they fail
CLIENT_LEFT = 499  # nginx's status for a request whose client closed the connection
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class AccessNote:
    """What a generation's handler tells the log about it."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token_at: float | None = None  # time.monotonic() of the first token sent


_NOTE: web.RequestKey[AccessNote] = web.RequestKey("access_note", AccessNote)


def access_note(request: web.Request) -> AccessNote:
    """The request's note, made on first use."""
    note = request.get(_NOTE)
    if note is None:
        note = request[_NOTE] = AccessNote()
    return note


def _route(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


@web.middleware
async def access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    start = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:  # a redirect, or an error past the errors middleware
        status = exc.status
        raise
    except asyncio.CancelledError:  # the client left
        status = CLIENT_LEFT
        raise
    finally:
        if not (request.path in QUIET and status < 300):
            _line(request, status, start)


def _line(request: web.Request, status: int, start: float) -> None:
    end = time.monotonic()
    fields: dict[str, object] = {
        "method": request.method,
        "route": _route(request),
        "status": status,
    }
    note = request.get(_NOTE)
    if note is not None:
        fields.update(
            prompt_tokens=note.prompt_tokens,
            completion_tokens=note.completion_tokens,
            cached_tokens=note.cached_tokens,
        )
        if note.first_token_at is not None:
            fields["ttft_s"] = round(note.first_token_at - start, 4)
    fields["duration_s"] = round(end - start, 4)
    log.info(f"{request.method} {fields['route']} {status}", **fields)


def install(app: web.Application) -> None:
    """Log every request of `app` (outermost, so that every answer is seen as sent)."""
    app.middlewares.insert(0, access_log)
