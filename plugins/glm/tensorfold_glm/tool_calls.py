"""GLM tool calls, in GLM-4.7-Flash's published format (the nearest published GLM template to
GLM-5.3-Flash), one section per call:

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>
    <arg_key>days</arg_key><arg_value>3</arg_value></tool_call>   (one line)

The template writes string values bare and every other value as JSON, so a value is read as the
parameter's schema says: a "string" parameter keeps its text; any other is read as JSON, and
kept as text when it is not JSON. Whitespace around the name and between pairs (GLM-4.5 writes
newlines there) is allowed.

Constrained calls (tool_choice "required" or named, `grammar`): each section names an offered
tool and writes its parameters in the schema's order, the required ones always, the others
optionally; a "string" parameter's value is bare text without "<" (its enum, or its
minLength / maxLength, held to), any other is compact JSON valid against the parameter's
schema. `$ref`s (to the parameters' `$defs`, as Pydantic writes nested models) are followed, and
a parameter's own schema is compiled with the `$defs` it may refer to. Schema keywords about the
arguments object as a whole (patternProperties, dependencies, minProperties) and a string
parameter's `pattern` or `format` are not enforced.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Sequence

from tensorfold.engine.tool_schemas import resolve, with_defs
from tensorfold.family.tool_calls import MalformedToolCall, Schemas, ToolCallFormat

START, END = "<tool_call>", "</tool_call>"
_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[^\s<>]+")


def _is_string(schema: Mapping[str, Any] | None) -> bool:
    kind = (schema or {}).get("type")
    return kind == "string" or (
        isinstance(kind, list) and bool(kind) and set(kind) <= {"string", "null"}
    )


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
    rest = body[len(head) :]
    root = schemas.get(name) or {}
    properties = resolve(root, root).get("properties") or {}
    arguments: dict[str, Any] = {}
    pos = 0
    while pos < len(rest):
        found = _PAIR.match(rest, pos)
        if found is None:
            if rest[pos:].strip():
                raise MalformedToolCall(
                    f"expected <arg_key>…</arg_value>: {rest[pos : pos + 40]!r}"
                )
            break
        key = found.group(1).strip()
        arguments[key] = _value(found.group(2), resolve(properties.get(key), root))
        pos = found.end()
    return [(name, arguments)]


def _string_value(schema: Mapping[str, Any]) -> str:
    """A bare string value as a Lark term: one of its enum, or text without '<'."""
    if isinstance(schema.get("enum"), list) and all(
        isinstance(e, str) and "<" not in e for e in schema["enum"]
    ):
        return "(" + " | ".join(json.dumps(e) for e in schema["enum"]) + ")"
    low = schema.get("minLength", 0)
    high = schema.get("maxLength", "")
    low = low if isinstance(low, int) and low >= 0 else 0
    high = high if isinstance(high, int) and high >= low else ""
    return f"/[^<]{{{low},{high}}}/"


def grammar(
    tools: Sequence[Mapping[str, Any]], parallel: bool, literal: Callable[[str], str]
) -> str:
    """Sections of calls to `tools` (one, or several when `parallel`), each argument valid
    against its parameter's schema (see the module doc for what is not enforced)."""
    from tensorfold.engine.structured import JSON_OPTIONS

    key_open, key_close, value_open, value_close = (
        literal(m) for m in ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    )
    rules = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        root = function.get("parameters") or {}
        parameters = resolve(root, root)
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or [])
        for key in required - set(properties):
            properties = {**properties, key: {}}
        terms = []
        for j, (key, schema) in enumerate(properties.items()):
            schema = resolve(schema, root)
            if _is_string(schema):
                value = _string_value(schema)
            else:
                whole = with_defs(schema, root)
                value = "%json" + json.dumps({**whole, "x-guidance": JSON_OPTIONS})
            rules.append(
                f"arg_{i}_{j}: {key_open} {json.dumps(key)} {key_close} {value_open} "
                f"{value} {value_close}"
            )
            terms.append(f"arg_{i}_{j}" + ("" if key in required else "?"))
        rules.append(
            f"call_{i}: {literal(START)} {json.dumps(function['name'])} "
            f"{' '.join(terms)} {literal(END)}"
        )
    calls = "call+" if parallel else "call"
    return "\n".join(
        [f"start: {calls}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules]
    )


FORMAT = ToolCallFormat(
    "glm47",
    START,
    END,
    parse,
    inner=("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    grammar=grammar,
)
