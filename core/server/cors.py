"""CORS, so that web pages from the origins in --allowed-origins (TF_ALLOWED_ORIGINS) may call
the server from a browser.

With no allowed origin nothing here is installed and nothing changes. Otherwise:
- a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) to a route that
  exists is answered here, before the API-key check (browsers never send credentials on a
  preflight): 204 with the allowed methods and headers for an allowed origin, 403 naming the
  origin for another;
- every response to an allowed origin, errors and event streams included, carries
  `Access-Control-Allow-Origin` (the request's origin), the allowed methods and headers; every
  response carries `Vary: Origin`, so that a cache never serves one origin's answer to another.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from aiohttp import hdrs, web

from .openai_api import error_body

ALLOW_HEADERS = "Authorization, Content-Type"
MAX_AGE_S = "600"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Cors:
    """The allowed origins ("*": any), and what answers for them."""

    def __init__(self, origins: Sequence[str]) -> None:
        self.any = "*" in origins
        self.origins = frozenset(o.lower().rstrip("/") for o in origins)

    def allows(self, origin: str | None) -> bool:
        return origin is not None and (self.any or origin.lower() in self.origins)

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Outermost: answers a preflight before any other middleware (the key check) runs."""
        origin = request.headers.get(hdrs.ORIGIN)
        if (
            request.method != hdrs.METH_OPTIONS
            or origin is None
            or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers
        ):
            return await handler(request)
        refused = request.match_info.http_exception
        if isinstance(refused, web.HTTPNotFound):
            return await handler(request)  # no such route: answered as any request to it
        if not self.allows(origin):
            message = f"the origin {origin!r} is not among the server's --allowed-origins"
            return web.json_response(
                error_body(403, message, code="origin_not_allowed"), status=403
            )
        resp = web.Response(status=204)
        asked = request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS)
        if asked:  # the openai clients send their own x-stainless-* headers too
            resp.headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = asked
        resp.headers[hdrs.ACCESS_CONTROL_MAX_AGE] = MAX_AGE_S
        return resp  # on_prepare adds the origin, methods and Vary

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every response, just before its headers go out (streams included)."""
        vary = response.headers.get(hdrs.VARY)
        if vary is None:
            response.headers[hdrs.VARY] = hdrs.ORIGIN
        elif hdrs.ORIGIN.lower() not in vary.lower():
            response.headers[hdrs.VARY] = f"{vary}, {hdrs.ORIGIN}"
        origin = request.headers.get(hdrs.ORIGIN)
        if not self.allows(origin):
            return
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin  # type: ignore[assignment]
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_METHODS] = _methods(request)
        response.headers.setdefault(hdrs.ACCESS_CONTROL_ALLOW_HEADERS, ALLOW_HEADERS)
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = "Retry-After"


def _methods(request: web.Request) -> str:
    """The route's methods (OPTIONS too), or GET, POST, OPTIONS where none matched."""
    refused = request.match_info.http_exception
    resource = request.match_info.route.resource
    if isinstance(refused, web.HTTPMethodNotAllowed):
        methods = set(refused.allowed_methods)
    elif refused is None and resource is not None:
        methods = {route.method for route in resource}
    else:
        methods = {hdrs.METH_GET, hdrs.METH_POST}
    methods.discard(hdrs.METH_HEAD)
    return ", ".join(sorted(methods | {hdrs.METH_OPTIONS}))


def install(app: web.Application, origins: Sequence[str]) -> None:
    """CORS for `origins` on `app` (before it starts); nothing when there are none."""
    if not origins:
        return
    cors = Cors(origins)
    app.middlewares.insert(0, cors.preflight)
    app.on_response_prepare.append(cors.on_prepare)
