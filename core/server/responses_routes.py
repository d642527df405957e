"""The /v1/responses routes: create (whole or streamed), retrieve, its input items, delete.

A create is translated into the chat request the server already runs (responses_api.py), made
ready and submitted as /v1/chat/completions' are (request_prepare, engine_run), and its reply
written in the Responses shapes (responses_replies.py). A response with `store` (the default)
is kept with its conversation (responses_store.py), so a follow-up naming it as
previous_response_id renders the whole conversation and the prompt store serves the prefix the
two share from the pages it kept.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from aiohttp import web

from ..config.logs import get_logger
from ..engine.requests import Finished, PromptOut, TokenOut
from .access_log import access_note
from .engine_run import RETRY_AFTER_S, EngineRun, Timing, engine_run
from .openai_api import ApiError, _get, bad, error_body, parse_chat, parse_json
from .openai_replies import dumps
from .request_limits import LIMITS, read_body
from .request_prepare import prepare
from .responses_api import ResponsesRequest, parse_responses, responses_error
from .responses_replies import ResponseShape, ResponseStream, assistant_turn
from .responses_store import RESPONSES, ResponsesStore, StoredResponse
from .state import STATE

log = get_logger("tensorfold.server")

_KEPT = ("completed", "incomplete")  # the statuses a stored response may have


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=dumps(body), status=status, content_type="application/json")


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    """OpenAI's 404 for an unknown id (its code for a previous_response_id, which clients that
    resend the whole conversation then look for)."""
    if param == "previous_response_id":
        message, code = "Previous response", "previous_response_not_found"
    else:
        message, code = "Response", None
    return ApiError(404, f"{message} with id {response_id!r} not found.", param=param, code=code)


def _prior(store: ResponsesStore, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation body's previous_response_id ended ([] without one)."""
    previous = _get(body, "previous_response_id", "str")
    if previous is None:
        return []
    if store.capacity <= 0:
        raise bad(
            "previous_response_id needs stored responses, and this server stores none "
            "(TF_RESPONSES_STORE=0); send the whole conversation as input",
            "previous_response_id",
        )
    stored = store.get(previous)
    if stored is None:
        raise _not_found(previous, "previous_response_id")
    return stored.conversation


def _keep(store: ResponsesStore, request: ResponsesRequest, response: dict[str, Any]) -> None:
    if request.store and response["status"] in _KEPT:
        conversation = [*request.conversation, assistant_turn(response["output"])]
        store.put(StoredResponse(response, conversation, request.input_items))


async def create(request: web.Request) -> web.StreamResponse:
    state, store, limits = request.app[STATE], request.app[RESPONSES], request.app[LIMITS]
    timing = Timing(state.metrics, access_note(request))
    raw = await read_body(request)
    loop = asyncio.get_running_loop()
    # Off the loop, as /v1/chat/completions' body; the store is read on the loop, in between.
    body = await loop.run_in_executor(limits.workers, parse_json, raw)
    prior = _prior(store, body)
    try:
        wanted = await loop.run_in_executor(limits.workers, parse_responses, body, prior)
        parsed = await prepare(request, wanted.chat, parse_chat, state.served)
    except ApiError as exc:
        raise responses_error(exc) from None
    parsed = replace(parsed, max_tokens_param="max_output_tokens")
    if state.draining:  # the signal came while the body was parsed
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": RETRY_AFTER_S})
    shape = ResponseShape(wanted, state.served.model_name)
    async with engine_run(state, parsed, timing) as run:
        if wanted.stream:
            return await _stream(request, run, wanted, shape, store)
        try:
            chat = (await run.whole()).response()
        except ApiError as exc:
            raise responses_error(exc) from None
    response = shape.whole(chat)
    _keep(store, wanted, response)
    return _json(response)


async def _stream(
    request: web.Request,
    run: EngineRun,
    wanted: ResponsesRequest,
    shape: ResponseShape,
    store: ResponsesStore,
) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    events = ResponseStream(shape)
    try:
        await resp.write(events.start())
        response = await _events_to_stream(resp, run, events)
        _keep(store, wanted, response)
    except ConnectionResetError:  # the client left; engine_run cancels the request
        pass
    except Exception as exc:  # headers are sent: the error goes out as the stream's last event
        log.exception("stream failed", error=str(exc))
        error = error_body(500, f"internal error: {type(exc).__name__}: {exc}")["error"]
        try:
            await resp.write(events.event("error", code="server_error", message=error["message"]))
        except ConnectionResetError:
            pass
    return resp


async def _events_to_stream(
    resp: web.StreamResponse, run: EngineRun, events: ResponseStream
) -> dict[str, Any]:
    reply = run.reply[0]  # one choice: /v1/responses has no n
    while True:
        batch = [await run.events.get()]
        while not run.events.empty():  # whatever else has come: one write for all of it
            batch.append(run.events.get_nowait())
        data = b""
        for _, event in batch:
            reply.add(event)
            if isinstance(event, TokenOut):
                run.timing.token()
            if not isinstance(event, PromptOut) and event.text:  # (no echo here: none come)
                data += events.feed(reply.sse_chunks(event.text, [], 0))
            if isinstance(event, Finished):
                data += events.feed(reply.finish())
        if reply.done is None:
            await resp.write(data)
            continue
        end, response = events.end(run.reply.usage())
        await resp.write(data + end)
        await resp.write_eof()
        return response


def _stored(request: web.Request) -> StoredResponse:
    response_id = request.match_info["response_id"]
    stored = request.app[RESPONSES].get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


async def retrieve(request: web.Request) -> web.Response:
    return _json(_stored(request).response)


async def delete(request: web.Request) -> web.Response:
    response_id = request.match_info["response_id"]
    if not request.app[RESPONSES].delete(response_id):
        raise _not_found(response_id)
    return _json({"id": response_id, "object": "response.deleted", "deleted": True})


def _limit(request: web.Request) -> int:
    text = request.query.get("limit", "20")
    if not text.isdigit() or not 1 <= int(text) <= 100:
        raise bad(f"limit must be an integer in 1..100, got {text[:20]!r}", "limit")
    return int(text)


async def input_items(request: web.Request) -> web.Response:
    items = list(_stored(request).input_items)
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad(f'order must be "asc" or "desc", got {order[:20]!r}', "order")
    if order == "desc":
        items.reverse()
    if (after := request.query.get("after")) is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad(f"after names no input item of this response: {after[:80]!r}", "after")
        items = items[ids.index(after) + 1 :]
    limit = _limit(request)
    page = items[:limit]
    return _json(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


def install(app: web.Application, kept: int) -> None:
    """The routes, and a store of `kept` responses (TF_RESPONSES_STORE; 0: none)."""
    app[RESPONSES] = ResponsesStore(kept)
    app.router.add_post("/v1/responses", create)
    app.router.add_get("/v1/responses/{response_id}", retrieve)
    app.router.add_delete("/v1/responses/{response_id}", delete)
    app.router.add_get("/v1/responses/{response_id}/input_items", input_items)
