"""When a stream stops, and which of its text may be released so far.

OpenAI semantics: a stop string ends the stream with finish_reason "stop" and is not part of the
output, nor is anything after it; the stop string that ends first wins, however the text was cut.
Text that could still grow into a stop string is held back until it cannot. Stop token ids, and
eos unless ignore_eos, end the stream with "stop" and their text is not emitted. Reaching
max_tokens ends it with "length". Checked in that order for each token.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

if TYPE_CHECKING:
    from tensorfold.engine.sampling import SamplingParams

FinishReason = Literal["stop", "length"]


class StopStep(NamedTuple):
    text: str  # may be released now
    finish_reason: FinishReason | None  # None: the stream goes on
    stop_reason: str | int | None = None  # matched stop string or stop token id (None for eos)


class StopChecker:
    """Feed it every generated token with its newly decoded text piece, in order."""

    def __init__(
        self,
        stop_strings: Sequence[str] = (),
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        ignore_eos: bool = False,
        max_tokens: int | None = None,
    ) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.stop_strings = tuple(stop_strings)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self._held = ""

    @classmethod
    def for_params(cls, params: SamplingParams, eos_token_ids: Iterable[int]) -> StopChecker:
        return cls(
            params.stop, params.stop_token_ids, eos_token_ids, params.ignore_eos, params.max_tokens
        )

    @property
    def held(self) -> str:
        """Text decoded but not yet released, as it may be the start of a stop string."""
        return self._held

    def feed(self, token_id: int, piece: str) -> StopStep:
        if self.finish_reason is not None:
            raise RuntimeError(f"the stream already finished ({self.finish_reason})")
        self.num_tokens += 1
        if token_id in self.stop_token_ids:
            return self._finish("stop", self.flush(), token_id)
        if token_id in self.eos_token_ids and not self.ignore_eos:
            return self._finish("stop", self.flush(), None)
        text = self._held + piece
        self._held = ""
        hit = self._find_stop(text)
        if hit is not None:
            start, stop = hit
            return self._finish("stop", text[:start], stop)
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._finish("length", text, None)
        cut = len(text) - self._partial_stop_len(text)
        self._held = text[cut:]
        return StopStep(text[:cut], None)

    def flush(self) -> str:
        """Release the held text, for a stream that ends for a reason of its own."""
        text, self._held = self._held, ""
        return text

    def _finish(self, reason: FinishReason, text: str, stop: str | int | None) -> StopStep:
        self.finish_reason = reason
        return StopStep(text, reason, stop)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop string that ends first in text, the longest on a tie:
        the one a character-by-character stream would hit, so pieces' cuts don't matter. Only
        held text + the new piece is searched: a stop string starting earlier would be held."""
        best: tuple[int, int, str] | None = None
        for stop in self.stop_strings:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return n
        return 0
