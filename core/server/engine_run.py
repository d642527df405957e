"""A request's run in the engine, shared by every route that generates (chat, completions,
responses): its choices submitted, their events carried onto the event loop, the request counted
in flight, and cancelled in the engine when its handler leaves before the end (the client went
away), so its lane and pages come back. Each route differs only in how it writes the replies."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ..engine.choices import choice_params
from ..engine.engine import QueueFull
from ..engine.requests import Event, RequestRefused, TokenOut
from .access_log import AccessNote
from .metrics import Metrics
from .openai_api import ApiError, Parsed
from .openai_replies import Choices
from .state import State

RETRY_AFTER_S = "1"


class Timing:
    """Time to first token and between tokens, as the client sees them."""

    def __init__(self, metrics: Metrics, note: AccessNote) -> None:
        self.metrics = metrics
        self.note = note  # the access log's: the first token's time, the tokens at the end
        self.last = time.monotonic()
        self.first = True

    def token(self) -> None:
        now = time.monotonic()
        (self.metrics.ttft if self.first else self.metrics.itl).observe(now - self.last)
        if self.first:
            self.note.first_token_at = now
        self.last, self.first = now, False


@dataclass
class EngineRun:
    """A submitted request: its replies as they grow, and the events still to read, each as
    (choice, event)."""

    reply: Choices
    events: asyncio.Queue[tuple[int, Event]]
    timing: Timing

    async def whole(self) -> Choices:
        """Every event read into the replies, to the end; a choice that ended with an error is
        an ApiError (a grammar past its budget is the request's fault: 400)."""
        while not self.reply.done:
            i, event = await self.events.get()
            if i == 0 and isinstance(event, TokenOut):
                self.timing.token()
            self.reply[i].add(event)
        if self.reply.error is not None:
            status, body = self.reply.error_response()
            raise ApiError(status, body["error"]["message"], code=body["error"]["code"])
        return self.reply


@contextlib.asynccontextmanager
async def engine_run(state: State, parsed: Parsed, timing: Timing) -> AsyncIterator[EngineRun]:
    """`parsed` submitted to the engine for as long as the block runs; refusals (the window, a
    full queue) are ApiErrors. A block left before the replies are done cancels the request."""
    mailbox = state.mailbox(asyncio.get_running_loop())
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()  # (choice, event)

    sampled = [0] * parsed.n  # each choice's tokens counted so far

    def sink(i: int, event: Event) -> None:  # on the engine thread
        # Counted here, as they come: a cancelled handler reads no more.
        if isinstance(event, TokenOut):
            sampled[i] += 1
            state.metrics.generation_tokens.inc()
        else:  # the rest of the choice's tokens (one its grammar refused is never sent)
            state.metrics.generation_tokens.inc(max(0, event.completion_tokens - sampled[i]))
            if i == 0:  # the request and its prompt, once
                state.metrics.finished(
                    parsed.kind, event.reason, event.prompt_tokens, event.cached_tokens
                )
        mailbox.put(events, (i, event))

    try:
        reqs = state.engine.submit_n(
            parsed.prompt_ids,
            choice_params(parsed.params, parsed.n),
            [functools.partial(sink, i) for i in range(parsed.n)],
            marks=parsed.marks,
            prediction=parsed.prediction,
        )
    except RequestRefused as exc:
        param = parsed.max_tokens_param if exc.param == "max_tokens" else exc.param
        code = "context_length_exceeded" if exc.param == "max_tokens" else None
        raise ApiError(400, str(exc), param=param, code=code) from None
    except QueueFull as exc:
        raise ApiError(
            503, f"the server is busy: {exc}", headers={"Retry-After": RETRY_AFTER_S}
        ) from None
    reply = Choices(parsed, state.served.model_name, reqs[0].params.seed, state.texts, parsed.n)
    state.inflight += 1
    for req in reqs:
        state.open[id(req)] = req
    state.idle.clear()
    try:
        yield EngineRun(reply, events, timing)
    finally:
        _note_tokens(timing.note, reply)
        if not reply.done:
            for req in reqs:
                state.engine.cancel(req)
        for req in reqs:
            state.open.pop(id(req), None)
        state.inflight -= 1
        if state.inflight == 0:
            state.idle.set()


def _note_tokens(note: AccessNote, reply: Choices) -> None:
    """The request's tokens, for the access log: the prompt once, every choice's completion."""
    ends = [r.done for r in reply.replies if r.done is not None]
    note.completion_tokens = sum(end.completion_tokens for end in ends)
    if ends:
        note.prompt_tokens, note.cached_tokens = ends[0].prompt_tokens, ends[0].cached_tokens
