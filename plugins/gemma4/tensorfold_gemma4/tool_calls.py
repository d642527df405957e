"""Gemma 4 tool calls, as its chat template renders an assistant's `tool_calls`, one section per
call:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:[<|"|>C<|"|>]}<tool_call|>

Gemma's own value syntax: strings between `<|"|>` quotes, keys bare (or quoted), true / false,
numbers, `[...]` lists and `{...}` objects. The model then writes `<|tool_response>` to hand the
turn to the tool (dropped here; it may also be a stop token).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tensorfold.tool_calls import MalformedToolCall, Schemas, ToolCallFormat

START, END, RESPONSE = "<|tool_call>", "<tool_call|>", "<|tool_response>"
QUOTE = '<|"|>'
_NAME = re.compile(r"[^\s{}<>]+")
_BARE = re.compile(r"[^,:{}\[\]\s]+")
_WORDS = {"true": True, "false": False, "null": None, "None": None, "True": True, "False": False}


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def take(self, what: str) -> bool:
        self.skip()
        if self.text.startswith(what, self.pos):
            self.pos += len(what)
            return True
        return False

    def expect(self, what: str) -> None:
        if not self.take(what):
            raise MalformedToolCall(f"expected {what!r} at {self.text[self.pos:self.pos + 30]!r}")

    def string(self) -> str:
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise MalformedToolCall("a string is not closed")
        out, self.pos = self.text[self.pos:end], end + len(QUOTE)
        return out

    def key(self) -> str:
        if self.take(QUOTE):
            return self.string()
        self.skip()
        found = _BARE.match(self.text, self.pos)
        if not found:
            raise MalformedToolCall(f"expected a key at {self.text[self.pos:self.pos + 30]!r}")
        self.pos = found.end()
        return found.group()

    def obj(self) -> dict[str, Any]:
        """After '{': key:value pairs up to '}'."""
        out: dict[str, Any] = {}
        if self.take("}"):
            return out
        while True:
            key = self.key()
            self.expect(":")
            out[key] = self.value()
            if self.take("}"):
                return out
            self.expect(",")

    def value(self) -> Any:
        if self.take(QUOTE):
            return self.string()
        if self.take("{"):
            return self.obj()
        if self.take("["):
            items: list[Any] = []
            if self.take("]"):
                return items
            while True:
                items.append(self.value())
                if self.take("]"):
                    return items
                self.expect(",")
        self.skip()
        found = _BARE.match(self.text, self.pos)
        if not found:
            raise MalformedToolCall(f"expected a value at {self.text[self.pos:self.pos + 30]!r}")
        self.pos = found.end()
        word = found.group()
        if word in _WORDS:
            return _WORDS[word]
        try:
            number = json.loads(word)
        except ValueError:
            raise MalformedToolCall(f"not a value: {word[:30]!r}") from None
        if not isinstance(number, (int, float)):
            raise MalformedToolCall(f"not a value: {word[:30]!r}")
        return number


def parse(body: str, schemas: Schemas) -> list[tuple[str, dict[str, Any]]]:
    reader = _Reader(body)
    reader.expect("call:")
    reader.skip()
    found = _NAME.match(body, reader.pos)
    if not found:
        raise MalformedToolCall("no function name after 'call:'")
    reader.pos = found.end()
    reader.expect("{")
    arguments = reader.obj()
    reader.skip()
    if reader.pos != len(body):
        raise MalformedToolCall(f"text after the arguments: {body[reader.pos:reader.pos + 30]!r}")
    return [(found.group(), arguments)]


FORMAT = ToolCallFormat("gemma4", START, END, parse, after=(RESPONSE,), inner=(QUOTE,))
