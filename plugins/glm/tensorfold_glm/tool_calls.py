"""GLM tool calls, in GLM-4.7-Flash's published format (the nearest published GLM template to
GLM-5.3-Flash), one section per call:

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>
    <arg_key>days</arg_key><arg_value>3</arg_value></tool_call>   (one line)

The template writes string values bare and every other value as JSON, so a value is read as the
parameter's schema says: a "string" parameter keeps its text; any other is read as JSON, and
kept as text when it is not JSON. Whitespace around the name and between pairs (GLM-4.5 writes
newlines there) is allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from tensorfold.tool_calls import MalformedToolCall, Schemas, ToolCallFormat

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[^\s<>]+")


def _is_string(schema: Mapping[str, Any] | None) -> bool:
    kind = (schema or {}).get("type")
    return kind == "string" or (
        isinstance(kind, list) and bool(kind) and set(kind) <= {"string", "null"})


def _value(text: str, schema: Mapping[str, Any] | None) -> Any:
    if _is_string(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse(body: str, schemas: Schemas) -> list[tuple[str, dict[str, Any]]]:
    head = body.partition("<arg_key>")[0]
    name = head.strip()
    if not _NAME.fullmatch(name):
        raise MalformedToolCall(f"no function name before the arguments: {head[:40]!r}")
    rest = body[len(head):]
    properties = (schemas.get(name) or {}).get("properties") or {}
    arguments: dict[str, Any] = {}
    pos = 0
    while pos < len(rest):
        found = _PAIR.match(rest, pos)
        if found is None:
            if rest[pos:].strip():
                raise MalformedToolCall(f"expected <arg_key>…</arg_value>: "
                                        f"{rest[pos:pos + 40]!r}")
            break
        key = found.group(1).strip()
        arguments[key] = _value(found.group(2), properties.get(key))
        pos = found.end()
    return [(name, arguments)]


FORMAT = ToolCallFormat("glm47", START, END, parse,
                        inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"))
