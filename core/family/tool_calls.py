"""Tool calls: the shared machinery that turns a family's tool-call markup in generated text into
OpenAI tool calls, whole or streamed. The core never guesses a format: each family describes its
own with a ToolCallFormat, which its plugin returns from the `tool_call_format` hook.

A format names the marker that opens a call section, the marker that closes it, and a function
that parses the text between them into (name, arguments) pairs. ToolCallStream does the rest for
every family:
- it finds sections in text that arrives in pieces of any size, holding back text that may be
  the start of the opening marker, so no markup ever reaches `content`;
- a call goes out once its section has closed and parsed: first a delta with its index, id and
  name, then one with its arguments (a JSON object, as a string). A section that does not parse,
  or that never closes, is left in the content exactly as the model wrote it;
- whitespace between the text and a call, between calls, and after the last call is dropped.
- a reply cut by max_tokens (`finish(cut=True)`) inside a section gives the calls that section
  completed (a format whose section holds a list says which, `partial`) and no markup.
Fed the whole text at once it gives the same content and calls as fed piece by piece, so the
whole reply and the stream agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..config.logs import get_logger

log = get_logger("tensorfold.tool_calls")
Schemas = Mapping[str, Mapping[str, Any]]  # tool name -> its JSON-schema `parameters`


class MalformedToolCall(ValueError):
    """A call section that does not parse; the message says where."""


@dataclass(frozen=True)
class ToolCallFormat:
    """A family's tool-call markup.

    name: a short label for logs and docs ("glm47", "gemma4", "lfm2").
    start / end: the markers that open and close a call section.
    parse(body, schemas): the calls in the text between the markers, as (name, arguments)
        pairs; raises MalformedToolCall when the body does not parse. `schemas` are the offered
        tools' parameter schemas by name, for formats whose values are untyped text.
    after: markers the model may write right after its calls (dropped, never content).
    inner: other tokens of the markup that `parse` reads (Gemma's string quote `<|"|>`, GLM's
        `<arg_key>`): where any marker is a special token of the tokenizer, it must still be
        decoded into the text.
    grammar(tools, parallel, literal): a Lark grammar (llguidance's dialect) for a reply that
        is only calls to `tools` (OpenAI tool entries), several when `parallel`; `literal(text)`
        gives a marker's Lark term (a special token's id, or quoted text). None: tool_choice
        "required" / named cannot be constrained in this format (tensorfold.engine.structured).
    partial(body, schemas): the calls complete in the body of a section cut short (max_tokens
        reached), for formats whose section holds several calls; None: a section is one call,
        so a cut one holds none.
    """

    name: str
    start: str
    end: str
    parse: Callable[[str, Schemas], list[tuple[str, dict[str, Any]]]]
    after: tuple[str, ...] = ()
    inner: tuple[str, ...] = ()
    grammar: Callable[[Sequence[Mapping[str, Any]], bool, Callable[[str], str]], str] | None = None
    partial: Callable[[str, Schemas], list[tuple[str, dict[str, Any]]]] | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """Every piece of the markup: what decoding must keep, were it special tokens."""
        return (self.start, self.end, *self.after, *self.inner)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def message(self) -> dict[str, Any]:
        """As OpenAI's `message.tool_calls[i]`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Piece:
    """What one step of the stream releases: content text, and `delta.tool_calls` items."""

    content: str = ""
    deltas: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: Piece) -> None:
        self.content += other.content
        self.deltas.extend(other.deltas)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def schemas_of(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The parameter schemas of OpenAI `tools` entries, by function name."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") or {}
        if isinstance(function.get("name"), str):
            out[function["name"]] = function.get("parameters") or {}
    return out


def held_prefix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    longest = max((len(m) for m in markers), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


class ToolCallStream:
    """Splits generated text into content and tool calls, incrementally (see the module doc).

    parallel=False keeps only the first call (OpenAI's parallel_tool_calls=false); later calls
    are dropped, not turned into content.
    """

    def __init__(
        self, fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]] = (), *, parallel: bool = True
    ) -> None:
        self.fmt = fmt
        self.schemas = schemas_of(tools)
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._buf = ""  # text not judged yet: a possible marker start, or an open section
        self._in_section = False
        self._scanned = 0  # how far into an open section's text the end marker is not
        self._ws = ""  # whitespace held back: it goes if a call follows
        self._ws_before_section = ""
        self._after_call = False  # nothing but whitespace since the last section

    def feed(self, text: str) -> Piece:
        self._buf += text
        out = Piece()
        while True:
            if self._in_section:
                end = self._buf.find(self.fmt.end, self._scanned)
                if end < 0:  # next time, search only where the end marker may still be
                    self._scanned = max(0, len(self._buf) - len(self.fmt.end) + 1)
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.fmt.end) :]
                self._in_section = False
                out.extend(self._section(body))
                continue
            if self._after_call and self._drop_after():
                continue
            start = self._buf.find(self.fmt.start)
            if start >= 0:
                out.content += self._text(self._buf[:start])
                self._ws_before_section, self._ws = self._ws, ""
                self._buf = self._buf[start + len(self.fmt.start) :]
                self._in_section, self._scanned = True, 0
                continue
            markers = [self.fmt.start, *(self.fmt.after if self._after_call else ())]
            keep = held_prefix(self._buf, markers)
            if self._after_call and self._buf.strip() == "":
                keep = len(self._buf)
            cut = len(self._buf) - keep
            out.content += self._text(self._buf[:cut])
            self._buf = self._buf[cut:]
            return out

    def finish(self, cut: bool = False) -> Piece:
        """The end of the text: an open section, or a held marker start, is content after all;
        unless the text was `cut` (max_tokens), where an open section gives the calls it
        completed and its markup goes."""
        out = Piece()
        if self._in_section and cut:
            out.extend(self._calls(self._partial(self._buf)))
        elif self._in_section:
            out.content += self._text(self._ws_before_section + self.fmt.start + self._buf)
        elif not (self._after_call and self._buf.strip() == ""):
            out.content += self._text(self._buf)
        self._buf, self._in_section = "", False
        if not self.calls:
            out.content += self._ws
        self._ws = ""
        return out

    def _drop_after(self) -> bool:
        """Drop a marker the format writes after its calls; True when one went."""
        stripped = self._buf.lstrip()
        for marker in self.fmt.after:
            if stripped.startswith(marker):
                self._buf = stripped[len(marker) :]
                return True
        return False

    def _text(self, text: str) -> str:
        """Content, with trailing whitespace held back until something other than a call
        follows it."""
        if not text:
            return ""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        if body:
            self._after_call = False
        return body

    def _partial(self, body: str) -> list[tuple[str, dict[str, Any]]]:
        if self.fmt.partial is None:
            return []
        try:
            return self.fmt.partial(body, self.schemas)
        except Exception as exc:  # a cut section's calls are a courtesy: none, if it breaks
            log.warning(
                "a tool-call parser failed on a cut section",
                format=self.fmt.name,
                error=f"{type(exc).__name__}: {exc}",
            )
            return []

    def _section(self, body: str) -> Piece:
        try:
            found = self.fmt.parse(body, self.schemas)
        except Exception as exc:  # a section that does not parse stays content, as written
            if not isinstance(exc, (MalformedToolCall, RecursionError)):
                log.warning(
                    "a tool-call parser failed",
                    format=self.fmt.name,
                    error=f"{type(exc).__name__}: {exc}",
                )
            self._ws = self._ws_before_section
            return Piece(self._text(self.fmt.start + body + self.fmt.end))
        return self._calls(found)

    def _calls(self, found: list[tuple[str, dict[str, Any]]]) -> Piece:
        out = Piece()
        for name, arguments in found:
            if not self.parallel and self.calls:
                break
            call = ToolCall(new_call_id(), name, json.dumps(arguments, ensure_ascii=False))
            index = len(self.calls)
            self.calls.append(call)
            out.deltas.append(
                {
                    "index": index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
            out.deltas.append({"index": index, "function": {"arguments": call.arguments}})
        self._after_call = True
        return out


def parse_tool_calls(
    fmt: ToolCallFormat,
    text: str,
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    parallel: bool = True,
    cut: bool = False,
) -> tuple[str, list[ToolCall]]:
    """The whole text at once: its content (markup and the whitespace around calls removed)
    and its calls; `cut`: the text ended at max_tokens (ToolCallStream.finish)."""
    stream = ToolCallStream(fmt, tools, parallel=parallel)
    piece = stream.feed(text)
    piece.extend(stream.finish(cut))
    return piece.content, stream.calls
