"""vLLM's beam search for /v1/completions (`use_beam_search`: `n` beams a prompt), run as vLLM's
server runs it: rounds of one-token requests through the engine.

Each round, every live beam (its prompt and the tokens it chose) is one prompt of a list
(`Engine.submit_prompts`) asking for one token and the 2n likeliest next tokens' logprobs. Each
(beam, candidate) scores its cumulative logprob; a candidate that is an end token (unless
ignore_eos) ends its beam, and the n best of the others go on. After max_tokens rounds, or when
no beam is left, the n best of all, by cumulative logprob / length ** length_penalty (the length
counts the prompt, less a final end token), are the choices, best first. Stop strings are not
looked for. A beam's next round resumes its prefix from the prompt store when it is on, and the
logprobs are the engine's own (the same alone or among other requests), so the beams are too.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field, replace
from typing import Literal

from ..engine.engine import Engine
from ..engine.requests import Event, Finished, Request, TokenOut
from ..engine.sampling import SamplingParams
from ..family.tokenizer import IncrementalDecoder, Tokenizer
from .state import Mailbox

MAX_TOP = 20  # the most top logprobs a row reports (SamplingParams)


@dataclass
class Beam:
    """A beam: the tokens it chose after the prompt, each with its round's logprobs."""

    tokens: list[int] = field(default_factory=list)
    logprob: float = 0.0  # cumulative
    steps: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    ended: bool = False  # its last token is an end token

    def score(self, prompt_len: int, length_penalty: float) -> float:
        """vLLM's beam score: the cumulative logprob over the length to the power."""
        length = prompt_len + len(self.tokens) - self.ended
        return self.logprob / (length**length_penalty)


async def search(
    engine: Engine,
    mailbox: Mailbox,
    prompt: list[int],
    params: SamplingParams,
    width: int,
    length_penalty: float,
    end_ids: frozenset[int],
) -> list[Beam]:
    """The `width` best beams after `prompt`, best first (params: seeded; its max_tokens the
    rounds, its ignore_eos and stop_token_ids the end tokens' rule)."""
    step = replace(
        params,
        max_tokens=1,
        logprobs=True,
        top_logprobs=min(2 * width, MAX_TOP),
        stop=(),
        stop_token_ids=(),
        ignore_eos=True,
        constraint=None,
    )
    ends = frozenset() if params.ignore_eos else end_ids | frozenset(params.stop_token_ids)
    live: list[Beam] = [Beam()]
    done: list[Beam] = []
    for _ in range(params.max_tokens):
        rows = await _one_round(engine, mailbox, [prompt + b.tokens for b in live], step)
        grown: list[Beam] = []
        for beam, (token, logprob, top) in zip(live, rows):
            candidates = dict(top)
            candidates.setdefault(token, logprob)
            for t, lp in candidates.items():
                ended = t in ends
                child = Beam(beam.tokens + [t], beam.logprob + lp, beam.steps + [(lp, top)], ended)
                (done if ended else grown).append(child)
        key = functools.partial(Beam.score, prompt_len=len(prompt), length_penalty=length_penalty)
        live = sorted(grown, key=key, reverse=True)[:width]
        if not live:
            break
    key = functools.partial(Beam.score, prompt_len=len(prompt), length_penalty=length_penalty)
    return sorted(done + live, key=key, reverse=True)[:width]


async def _one_round(
    engine: Engine, mailbox: Mailbox, prompts: list[list[int]], step: SamplingParams
) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Each prompt's next token, its logprob and the top ones, from one list of requests."""
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def sink(i: int, event: Event) -> None:  # on the engine thread
        mailbox.put(events, (i, event))

    groups = engine.submit_prompts(
        prompts,
        [[step]] * len(prompts),
        [functools.partial(sink, i) for i in range(len(prompts))],
    )
    rows: dict[int, tuple[int, float, list[tuple[int, float]]]] = {}
    ended = 0
    try:
        while ended < len(prompts):
            i, event = await events.get()
            if isinstance(event, TokenOut):
                rows[i] = (event.token, event.logprob, event.top_logprobs)
            elif isinstance(event, Finished):
                ended += 1
                if event.error is not None or i not in rows:
                    raise RuntimeError(event.error or f"a beam's round ended {event.reason}")
    finally:
        if ended < len(prompts):  # cancelled (the client left) or failed: the rest end too
            for group in groups:
                for req in group:
                    engine.cancel(req)
    return [rows[i] for i in range(len(prompts))]


def beam_events(
    beam: Beam,
    request_id: str,
    prompt_len: int,
    params: SamplingParams,
    tokenizer: Tokenizer | None,
) -> list[Event]:
    """A finished beam as the engine would have reported its tokens: TokenOut by TokenOut,
    then Finished ("stop" at an end token, else "length")."""
    keep = frozenset(params.keep_special_ids)
    decoder = IncrementalDecoder(tokenizer, keep=keep) if tokenizer is not None else None
    out: list[Event] = []
    for t, (token, (logprob, top)) in enumerate(zip(beam.tokens, beam.steps)):
        text = decoder.step([token]) if decoder is not None else ""
        top_n = top[: params.top_logprobs] if params.logprobs else []
        out.append(TokenOut(request_id, t, token, text, logprob, top_n))
    tail = decoder.flush() if decoder is not None else ""
    reason: Literal["stop", "length"] = "stop" if beam.ended else "length"
    out.append(Finished(request_id, reason, tail, prompt_len, len(beam.tokens), 0, params.seed))
    return out


def check(engine: Engine, prompt: list[int], params: SamplingParams) -> None:
    """RequestRefused now when the prompt and its rounds can never run here (the window)."""
    engine.lanes.check(Request(list(prompt), params, lambda event: None))
