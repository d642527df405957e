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
from typing import Any, Callable, Mapping, Sequence

from tensorfold.engine.tool_schemas import resolve
from tensorfold.family.tool_calls import MalformedToolCall, Schemas, ToolCallFormat

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
            raise MalformedToolCall(f"expected {what!r} at {self.text[self.pos : self.pos + 30]!r}")

    def string(self) -> str:
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise MalformedToolCall("a string is not closed")
        out, self.pos = self.text[self.pos : end], end + len(QUOTE)
        return out

    def key(self) -> str:
        if self.take(QUOTE):
            return self.string()
        self.skip()
        found = _BARE.match(self.text, self.pos)
        if not found:
            raise MalformedToolCall(f"expected a key at {self.text[self.pos : self.pos + 30]!r}")
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
            raise MalformedToolCall(f"expected a value at {self.text[self.pos : self.pos + 30]!r}")
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
        raise MalformedToolCall(f"text after the arguments: {body[reader.pos : reader.pos + 30]!r}")
    return [(found.group(), arguments)]


class _Grammar:
    """Lark rules for Gemma's value syntax, typed by a JSON schema: strings quoted with <|"|>
    (bare text without '<'; enum, const, minLength and maxLength held to), numbers, integers,
    booleans and null as JSON writes them (with their bounds), arrays of such values, objects
    with bare keys (their required members always, the others optionally), anyOf / oneOf and
    type lists as alternatives, and `$ref`s to the schema's `$defs` as rules of their own (so a
    recursive schema is a recursive grammar). Not enforced: a string's pattern or format, an
    array's length bounds and uniqueItems, object keywords other than properties and required;
    a schema with keywords beyond these (allOf, not, ...) takes any Gemma value."""

    def __init__(self, literal: Callable[[str], str]) -> None:
        self.quote = literal(QUOTE)
        self.rules: list[str] = []
        self.refs: dict[str, str] = {}
        self.root: Mapping[str, Any] = {}
        self.any: str | None = None

    def rule(self, body: str) -> str:
        name = f"v{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def later(self) -> int:
        """A rule's place, taken now and filled in once its body is built (recursion)."""
        self.rules.append("")
        return len(self.rules) - 1

    def value(self, schema: Any) -> str:
        from tensorfold.engine.structured import JSON_OPTIONS

        schema = schema if isinstance(schema, dict) else {}
        ref = schema.get("$ref")
        if isinstance(ref, str):
            return self.ref(ref)
        kind = schema.get("type")
        enum = schema.get("enum")
        if "const" in schema:
            enum = [schema["const"]]
        alternatives = schema.get("anyOf") or schema.get("oneOf")
        if isinstance(alternatives, list) and alternatives:
            rest = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
            return self.rule(
                " | ".join(
                    self.value({**rest, **a}) if isinstance(a, dict) else self.value(rest)
                    for a in alternatives
                )
            )
        if isinstance(kind, list) and kind:
            return self.rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
            return self.rule(" | ".join(f"{self.quote} {json.dumps(e)} {self.quote}" for e in enum))
        if kind == "string":
            low = schema.get("minLength", 0)
            high = schema.get("maxLength", "")
            low = low if isinstance(low, int) and low >= 0 else 0
            high = high if isinstance(high, int) and high >= low else ""
            return self.rule(f"{self.quote} /[^<]{{{low},{high}}}/ {self.quote}")
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.rule(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" or (kind is None and "properties" in schema):
            return self.obj(schema)
        if kind in ("integer", "number", "boolean", "null") or isinstance(enum, list):
            return self.rule("%json" + json.dumps({**schema, "x-guidance": JSON_OPTIONS}))
        return self.any_value()

    def ref(self, ref: str) -> str:
        """A `$ref` (its sibling keywords aside): one rule per target, made before its body
        so that it may recur."""
        if ref not in self.refs:
            at = self.later()
            self.refs[ref] = f"v{at}"
            self.rules[at] = f"v{at}: {self.value(resolve({'$ref': ref}, self.root))}"
        return self.refs[ref]

    def any_value(self) -> str:
        """Any Gemma value: for a schema whose keywords this grammar does not follow."""
        if self.any is None:
            at = self.later()
            self.any = f"v{at}"
            member = self.rule(f'/[A-Za-z_][A-Za-z0-9_]*/ ":" {self.any}')
            scalar = "%json" + json.dumps({"type": ["number", "boolean", "null"]})
            self.rules[at] = (
                f"{self.any}: {self.quote} /[^<]*/ {self.quote} | {scalar} "
                f'| "[" ({self.any} ("," {self.any})*)? "]" '
                f'| "{{" ({member} ("," {member})*)? "}}"'
            )
        return self.any

    def obj(self, schema: Mapping[str, Any]) -> str:
        """'{' members '}': required members first, then optional ones, commas between."""
        properties = schema.get("properties") or {}
        required = [k for k in properties if k in set(schema.get("required") or [])]
        optional = [k for k in properties if k not in required]
        member = {
            k: self.rule(f'{json.dumps(k)} ":" {self.value(properties[k])}') for k in properties
        }
        if required:
            head = ' "," '.join(member[k] for k in required)
            tail = " ".join(f'("," {member[k]})?' for k in optional)
            return self.rule(f'"{{" {head} {tail} "}}"')
        choices = ['""']
        for i, k in enumerate(optional):  # the first member present is optional[i]
            tail = " ".join(f'("," {member[o]})?' for o in optional[i + 1 :])
            choices.append(f"{member[k]} {tail}")
        inner = self.rule(" | ".join(choices))
        return self.rule(f'"{{" {inner} "}}"')


def grammar(
    tools: Sequence[Mapping[str, Any]], parallel: bool, literal: Callable[[str], str]
) -> str:
    """Sections of calls to `tools` (one, or several when `parallel`), each argument typed by
    its parameter's schema (see _Grammar for what is not enforced)."""
    g = _Grammar(literal)
    calls = []
    for tool in tools:
        function = tool["function"]
        g.root = function.get("parameters") or {}
        parameters = dict(resolve(g.root, g.root))
        parameters.setdefault("type", "object")
        arguments = g.obj(parameters)
        g.refs = {}  # each tool's $defs are its own
        calls.append(
            g.rule(
                f'{literal(START)} "call:" {json.dumps(function["name"])} '
                f"{arguments} {literal(END)}"
            )
        )
    call = g.rule(" | ".join(calls))
    return "\n".join([f"start: {call}+" if parallel else f"start: {call}", *g.rules])


FORMAT = ToolCallFormat(
    "gemma4", START, END, parse, after=(RESPONSE,), inner=(QUOTE,), grammar=grammar
)
