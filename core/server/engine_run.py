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
from dataclasses import dataclass, replace
from typing import Callable, Literal

from ..config.logs import get_logger
from ..engine.choices import choice_params
from ..engine.engine import QueueFull
from ..engine.requests import Event, Finished, RequestRefused, TokenOut
from . import beam_search
from .access_log import AccessNote
from .metrics import Metrics
from .openai_api import ApiError, Parsed
from .openai_replies import Choices
from .state import State

RETRY_AFTER_S = "1"
log = get_logger("tensorfold.server")


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
    prompts, n = parsed.prompts, parsed.n  # choice i is prompt i // n's choice i % n

    sampled = [0] * (len(prompts) * n)  # each choice's tokens counted so far

    def sink(i: int, event: Event) -> None:  # on the engine thread
        # Counted here, as they come: a cancelled handler reads no more.
        if isinstance(event, TokenOut):
            sampled[i] += 1
            state.metrics.generation_tokens.inc()
        elif isinstance(event, Finished):  # the rest (one its grammar refused is never sent)
            state.metrics.generation_tokens.inc(max(0, event.completion_tokens - sampled[i]))
            if i == 0:  # the request, once
                state.metrics.finished(parsed.kind, event.reason)
            if i % n == 0:  # each prompt, once
                state.metrics.prompted(event.prompt_tokens, event.cached_tokens)
        if parsed.echo_only:  # max_tokens 0: the one token drawn is not the reply's
            if isinstance(event, TokenOut):
                return
            if isinstance(event, Finished) and event.reason in ("stop", "length"):
                event = replace(event, reason="length", text="", completion_tokens=0)
        mailbox.put(events, (i, event))

    seed = parsed.params.with_seed().seed  # one for every prompt, drawn when not given
    echo_logprobs = parsed.echo and parsed.params.logprobs
    beams: asyncio.Task[None] | None = None
    try:
        if parsed.beam_search:
            for one in prompts:
                beam_search.check(state.engine, one.prompt_ids, replace(one.params, seed=seed))
            groups = []
            beams = asyncio.create_task(_beams(state, parsed, seed, sink))
        else:
            groups = state.engine.submit_prompts(
                [one.prompt_ids for one in prompts],
                [choice_params(replace(one.params, seed=seed), n) for one in prompts],
                [functools.partial(sink, i) for i in range(len(prompts) * n)],
                marks=[one.marks for one in prompts],
                prediction=parsed.prediction,
                prompt_logprobs=parsed.params.top_logprobs if echo_logprobs else None,
                media=[one.media for one in prompts],
            )
    except RequestRefused as exc:
        param = parsed.max_tokens_param if exc.param == "max_tokens" else exc.param
        code = "context_length_exceeded" if exc.param == "max_tokens" else None
        raise ApiError(400, str(exc), param=param, code=code) from None
    except QueueFull as exc:
        raise ApiError(
            503, f"the server is busy: {exc}", headers={"Retry-After": RETRY_AFTER_S}
        ) from None
    reqs = [req for group in groups for req in group]
    reply = Choices(parsed, state.served.model_name, seed, state.texts, n)
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
            if beams is not None:
                beams.cancel()
        for req in reqs:
            state.open.pop(id(req), None)
        state.inflight -= 1
        if state.inflight == 0:
            state.idle.set()


async def _beams(
    state: State, parsed: Parsed, seed: int | None, sink: Callable[[int, Event], None]
) -> None:
    """Beam search (`use_beam_search`) for each prompt at once; each prompt's n beams, best
    first, reported to its choices' sinks as the engine would report them. A failure (a full
    queue in a later round) ends every choice not yet ended with it."""
    n, mailbox = parsed.n, state.mailbox(asyncio.get_running_loop())
    ends = state.engine.lanes.eos_token_ids

    ended: set[int] = set()

    def report(i: int, event: Event) -> None:
        if isinstance(event, Finished):
            ended.add(i)
        sink(i, event)

    async def one(i: int, prompt: Parsed) -> None:
        params = replace(prompt.params, seed=seed)
        found = await beam_search.search(
            state.engine, mailbox, prompt.prompt_ids, params, n, parsed.length_penalty, ends
        )
        for j, beam in enumerate(found):
            for event in beam_search.beam_events(
                beam, f"beam-{i}-{j}", len(prompt.prompt_ids), params, state.served.tokenizer
            ):
                report(i * n + j, event)

    def end_the_rest(reason: Literal["cancelled", "error"], error: str | None = None) -> None:
        for i, prompt in enumerate(parsed.prompts):
            size = len(prompt.prompt_ids)
            for j in range(n):
                if i * n + j not in ended:
                    sink(i * n + j, Finished(f"beam-{i}-{j}", reason, "", size, 0, 0, seed, error))

    try:
        try:
            async with asyncio.TaskGroup() as group:  # a failure cancels the other prompts'
                for i, prompt in enumerate(parsed.prompts):
                    group.create_task(one(i, prompt))
        except* (RuntimeError, QueueFull, RequestRefused) as failed:
            log.warning("beam search failed", error=str(failed.exceptions[0]))
            end_the_rest("error", str(failed.exceptions[0]))
    except asyncio.CancelledError:  # the client left: counted as a cancelled request
        end_the_rest("cancelled")
        raise


def _note_tokens(note: AccessNote, reply: Choices) -> None:
    """The request's tokens, for the access log: each prompt once, every choice's completion."""
    ends = [r.done for r in reply.replies if r.done is not None]
    note.completion_tokens = sum(end.completion_tokens for end in ends)
    firsts = [r.done for r in reply.firsts if r.done is not None]
    if firsts:
        note.prompt_tokens = sum(end.prompt_tokens for end in firsts)
        note.cached_tokens = sum(end.cached_tokens for end in firsts)
