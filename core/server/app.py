"""The OpenAI-compatible HTTP API (aiohttp): routes, streaming, errors.

Engine events arrive on the engine thread; each request's sink hands them to the event loop
through a `Mailbox` (one call_soon_threadsafe for whatever has come since the loop last woke).
A request whose client goes away (the handler is cancelled, or a write fails) is cancelled in
the engine, so its lane and pages come back. What the handlers share (`State`, the mailbox) is
in state.py.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

from aiohttp import web

from ..config.logs import get_logger
from ..engine.requests import Event, Finished, PromptOut, TokenOut
from . import cors, openapi, responses_routes, status_page, tokenize_routes
from .access_log import access_note
from .access_log import install as install_access_log
from .api_key import bearer_matches, needs_key
from .engine_run import RETRY_AFTER_S, Timing, engine_run
from .metrics import CONTENT_TYPE
from .openai_api import ApiError, Parsed, error_body, parse_chat, parse_completion
from .openai_replies import Choices, dumps, sse
from .request_limits import LIMITS, Limits, read_body
from .request_prepare import prepare
from .state import STATE, Mailbox, State  # noqa: F401 (Mailbox: where the old server.py had it)

if TYPE_CHECKING:
    from ..engine.start import Served

log = get_logger("tensorfold.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=dumps(body), status=status, headers=headers, content_type="application/json"
    )


def _error(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    return json_response(error_body(status, message, param, code), status, headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        return await handler(request)
    except ApiError as exc:
        state.metrics.errors.labels(str(exc.status)).inc()
        return json_response(exc.body(), exc.status, exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        state.metrics.errors.labels(str(exc.status)).inc()
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        message = (
            exc.text
            if exc.text and not exc.text.startswith(f"{exc.status}:")
            else (f"{exc.reason}: {request.method} {request.path}")
        )
        return _error(exc.status, message, headers=headers)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # nothing a request does may take the server down
        log.exception("request failed", path=request.path, error=str(exc))
        state.metrics.errors.labels("500").inc()
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


@web.middleware
async def gate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if needs_key(request.path):
        if state.api_key is not None:
            if not bearer_matches(request.headers.get("Authorization", ""), state.api_key):
                raise ApiError(
                    401,
                    "a valid API key is needed: Authorization: Bearer KEY",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        if state.draining and request.method == "POST":
            raise ApiError(
                503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S}
            )
    return await handler(request)


async def _generate(request: web.Request, parse: Callable[..., Parsed]) -> web.StreamResponse:
    state = request.app[STATE]
    timing = Timing(state.metrics, access_note(request))
    # Off the loop: a big body's JSON, a long prompt's template and tokenizer would stall it.
    parsed = await prepare(request, await read_body(request), parse, state.served)
    if state.draining:  # the signal came while the body was parsed
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S})
    async with engine_run(state, parsed, timing) as run:
        if parsed.stream:
            return await _stream(request, run.reply, run.events, timing)
        return json_response((await run.whole()).response())


async def _stream(
    request: web.Request, reply: Choices, events: asyncio.Queue[tuple[int, Event]], timing: Timing
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    try:
        await _events_to_stream(resp, reply, events, timing)
    except ConnectionResetError:  # the client left; _generate cancels the request
        pass
    except Exception as exc:  # headers are sent: the error goes out as the stream's last event
        log.exception("stream failed", error=str(exc))
        error = error_body(500, f"internal error: {type(exc).__name__}: {exc}")
        try:
            await resp.write(sse(error) + sse(b"[DONE]"))
        except ConnectionResetError:
            pass
    return resp


async def _events_to_stream(
    resp: web.StreamResponse,
    replies: Choices,
    events: asyncio.Queue[tuple[int, Event]],
    timing: Timing,
) -> None:
    if replies.chat:
        await resp.write(b"".join(sse(r.chunk("", [], 0, first=True)) for r in replies.replies))
    sent = [0] * len(replies.replies)  # characters already sent, for completions' text_offset
    # echo: each choice's first chunk is its prompt, once its logprobs have come (a PromptOut)
    # when it asked for them, else at once
    echoing = replies.parsed.echo and bool(replies.parsed.params.logprobs)
    if replies.parsed.echo and not echoing:
        await resp.write(b"".join(r.echo_sse() for r in replies.replies))
        sent = [len(r.echo_text) for r in replies.replies]
    data = b""
    while True:
        batch = [await events.get()]
        while not events.empty():  # whatever else has come: one write for all of it
            batch.append(events.get_nowait())
        for i, event in batch:
            reply = replies[i]  # each chunk carries its choice's index
            reply.add(event)
            if isinstance(event, PromptOut):
                if echoing:
                    data += reply.echo_sse()
                    sent[i] = len(reply.echo_text)
                continue
            tokens = []
            if isinstance(event, TokenOut):
                if i == 0:
                    timing.token()
                tokens = [event] if reply.parsed.params.logprobs else []
            if event.text or tokens:
                data += reply.sse_chunks(event.text, tokens, sent[i])
                sent[i] += len(event.text)
            if isinstance(event, Finished):
                data += reply.finish()
        if replies.done:
            data += replies.ending()
        await resp.write(data)
        data = b""
        if replies.done:
            await resp.write_eof()
            return


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, parse_chat)


def _model_card(state: State) -> dict[str, Any]:
    """OpenAI's model object, vLLM's max_model_len, and what the model takes: `capabilities`
    as Ollama and llama.cpp's server list them ("vision" when it takes images) and
    `input_modalities` as OpenRouter's model list has them ("text", "image")."""
    vision = "image" in state.media_kinds
    return {
        "id": state.served.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "tensorfold",
        "max_model_len": state.served.window,
        "capabilities": ["completion", "vision"] if vision else ["completion"],
        "input_modalities": ["text", *state.media_kinds],
    }


async def models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if request.match_info["name"] != state.served.model_name:
        raise ApiError(
            404,
            f"the model {request.match_info['name']!r} does not exist",
            param="model",
            code="model_not_found",
        )
    return json_response(_model_card(state))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return _error(503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S})
    if not state.served.engine.alive:
        return _error(503, "the engine thread is not running")
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def create_app(
    served: Served,
    *,
    device: str = "cpu",
    api_key: str | None = None,
    limits: Limits | None = None,
    allowed_origins: Sequence[str] = (),
    responses_store: int = 1024,
    access_log: bool = True,
) -> web.Application:
    limits = limits or Limits()
    app = web.Application(
        middlewares=[errors_middleware, gate_middleware], client_max_size=limits.max_body
    )
    cors.install(app, allowed_origins)  # its preflight answers before the key check
    if access_log:
        install_access_log(app)
    app[STATE] = State(served, device, api_key)
    app[LIMITS] = limits
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    responses_routes.install(app, responses_store)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    tokenize_routes.install(app, served)
    status_page.install(app, app[STATE])
    openapi.install(app)
    return app
