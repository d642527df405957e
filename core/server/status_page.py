"""The live status page: `GET /status` (and `/`, which sends you there), its script and style,
and `GET /status/events`, the server-sent events that feed it (status_feed).

Read-only. With an API key, every route here needs it, as `Authorization: Bearer KEY`, as
`?key=KEY`, or as the cookie that `/status?key=KEY` sets (a browser's EventSource cannot send
a header): the page is then reloaded without the key in its address.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .api_key import bearer_matches, key_matches
from .openai_api import ApiError
from .status_feed import INTERVAL_S, StatusFeed

if TYPE_CHECKING:
    from .state import State

COOKIE = "tensorfold_key"
FEED: web.AppKey[StatusFeed] = web.AppKey("status_feed", StatusFeed)
FILES = {"status.js": "text/javascript", "status.css": "text/css"}


def install(app: web.Application, state: State) -> None:
    app[FEED] = StatusFeed(state)
    app.on_shutdown.append(_close)
    page = _read("status.html")
    files = {name: (_read(name), kind) for name, kind in FILES.items()}

    async def root(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(request.rel_url.with_path("/status").with_query(request.query))

    async def status(request: web.Request) -> web.StreamResponse:
        by_query = _allowed(request)
        if by_query:  # keep the key in a cookie, not in the address bar and the history
            rest = {k: v for k, v in request.query.items() if k != "key"}
            resp = web.HTTPSeeOther(request.rel_url.with_query(rest))
            resp.set_cookie(
                COOKIE, request.query["key"], path="/status", httponly=True, samesite="Strict"
            )
            raise resp
        return web.Response(
            body=page,
            content_type="text/html",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )

    async def static(request: web.Request) -> web.StreamResponse:
        _allowed(request)
        body, kind = files[request.match_info["name"]]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    app.router.add_get("/", root)
    app.router.add_get("/status", status)
    app.router.add_get("/status/{name:status\\.(?:js|css)}", static)
    app.router.add_get("/status/events", events)


async def events(request: web.Request) -> web.StreamResponse:
    """`hello` (the model and the plan), `history` (the recent points), then a summary every
    INTERVAL_S while the page is open."""
    _allowed(request)
    feed = request.app[FEED]
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    queue = feed.subscribe()
    try:
        await resp.write(
            _sse(json.dumps(_hello(feed.state)).encode(), "hello")
            + _sse(feed.history_message(), "history")
        )
        while (message := await queue.get()) is not None:
            await resp.write(_sse(message))
    except ConnectionResetError:  # the page was closed
        pass
    finally:
        feed.unsubscribe(queue)
    return resp


def _allowed(request: web.Request) -> bool:
    """Raises 401 unless the key (if the server has one) came with the request; True when it
    came as `?key=`."""
    key = request.app[FEED].state.api_key
    if key is None:
        return False
    if key_matches(request.query.get("key"), key):
        return True
    if bearer_matches(request.headers.get("Authorization", ""), key) or key_matches(
        request.cookies.get(COOKIE), key
    ):
        return False
    raise ApiError(
        401,
        "a valid API key is needed: open /status?key=KEY, or send Authorization: Bearer KEY",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _hello(state: State) -> dict[str, Any]:
    served = state.served
    return {
        "model": served.model_name,
        "family": served.family_note,
        "plan": {**dataclasses.asdict(served.plan), "line": served.plan.startup_line()},
        "asked": served.asked,
        "window": served.window,
        "interval_s": INTERVAL_S,
    }


def _sse(data: bytes, event: str | None = None) -> bytes:
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


def _read(name: str) -> bytes:
    return resources.files("tensorfold.server").joinpath("status", name).read_bytes()


async def _close(app: web.Application) -> None:
    app[FEED].close()
