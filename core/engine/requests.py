"""A request as the engine takes it, and the events it sends back."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Union

from ..family.media import MediaPiece
from .sampling import SamplingParams

_ids = itertools.count()


class RequestRefused(ValueError):
    """A request that can never run here (too long for the window or the pool); `param` names
    the request field at fault, for an OpenAI-shaped error."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class TokenOut:
    request_id: str
    index: int  # output position t
    token: int
    text: str  # text this token releases (may be empty while a stop string could still match)
    logprob: float
    top_logprobs: list[tuple[int, float]]


@dataclass(frozen=True)
class Finished:
    request_id: str
    reason: Literal["stop", "length", "cancelled", "error"]
    text: str  # text released at the end
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seed: int | None
    error: str | None = None
    drafted_tokens: int = 0  # draft tokens verify rounds checked (a prediction's and others')
    accepted_tokens: int = 0  # of them, kept
    accepted_prediction_tokens: int = 0  # of the request's prediction, kept as drafts
    rejected_prediction_tokens: int = 0  # of the request's prediction, drafted and refused


@dataclass(frozen=True)
class PromptOut:
    """The prompt's own logprobs (a request with `prompt_logprobs`, OpenAI's `echo` with
    `logprobs`), sent once, after the prompt pass and before the first TokenOut: for prompt
    tokens 1..n-1, each one's logprob under the rows before it and the top ones there (token 0
    has none)."""

    request_id: str
    logprobs: list[tuple[float, list[tuple[int, float]]]]  # (logprob, [(id, logprob)...])


Event = Union[TokenOut, PromptOut, Finished]


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams  # seeded (params.with_seed()) before it is submitted
    sink: Callable[[Event], None]
    id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    marks: tuple[int, ...] = ()  # chat marks: prompt positions where a turn ends
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    # n > 1: choices 1..n-1 of this prompt; they fork from this one once its prompt is computed
    forks: list["Request"] = field(default_factory=list)
    # Predicted Outputs: tokens the output is expected to repeat, used as this stream's drafts
    prediction: tuple[int, ...] = ()
    # the prompt tokens' logprobs, with this many top ones each (PromptOut), or None: not asked.
    # Computed in the prompt pass, so such a request computes its whole prompt (no store hit).
    prompt_logprobs: int | None = None
    # images (later video, audio) in the prompt, in prompt order: their rows' ids are the
    # family's placeholders, their embeddings the family's tower's (FamilyModel.encode_media)
    media: tuple[MediaPiece, ...] = ()
