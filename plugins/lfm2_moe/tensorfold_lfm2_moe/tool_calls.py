"""LFM2 / LFM2.5 tool calls, as Liquid AI's models write them and LFM2.5's chat template renders
an assistant's `tool_calls`:

    <|tool_call_start|>[get_weather(city="Paris", days=3), get_time(zone='CET')]<|tool_call_end|>

A Python list of calls with keyword arguments only. Values are Python literals (LFM2.5's template
writes strings in single quotes and lists with Python's repr) or JSON (its template writes
objects with tojson, so `true`, `false` and `null` count too). Liquid's models also write the
list as JSON when a system prompt asks for it: `[{"name": ..., "arguments": {...}}]`.
Parsed with `ast.parse`, never evaluated.

Constrained calls (tool_choice "required" or named) are written in the JSON form, which the
grammar can hold to each tool's parameter schema: `[{"name": "f", "arguments": {...}}]`.

A list cut short by max_tokens (`partial`) gives the calls it completed: the list read up to the
last call closed at its top level.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Callable, Mapping, Sequence

from tensorfold.family.tool_calls import MalformedToolCall, Schemas, ToolCallFormat

START, END = "<|tool_call_start|>", "<|tool_call_end|>"
_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _value(node: ast.AST) -> Any:
    if (
        isinstance(node, ast.Constant)
        and not isinstance(node.value, (bytes, complex))
        and (node.value is not Ellipsis)
    ):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        inner = _value(node.operand)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner if isinstance(node.op, ast.USub) else inner
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _value(k) if k is not None else None
            if not isinstance(key, str):
                raise MalformedToolCall("object keys must be strings")
            out[key] = _value(v)
        return out
    raise MalformedToolCall(f"not a literal value: {ast.dump(node)[:60]}")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise MalformedToolCall("a call's function must be a name")


def _call(node: ast.AST) -> tuple[str, dict[str, Any]]:
    if isinstance(node, ast.Call):
        if node.args:
            raise MalformedToolCall("tool calls take keyword arguments only")
        if any(k.arg is None for k in node.keywords):
            raise MalformedToolCall("**kwargs is not an argument")
        arguments = {str(k.arg): _value(k.value) for k in node.keywords}
        return _dotted(node.func), arguments
    if isinstance(node, ast.Dict):  # the JSON form
        call = _value(node)
        name, arguments = call.get("name"), call.get("arguments", call.get("parameters", {}))
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise MalformedToolCall('a JSON call needs "name" and an "arguments" object')
        return name, arguments
    raise MalformedToolCall("expected name(key=value, ...)")


def parse(body: str, schemas: Schemas) -> list[tuple[str, dict[str, Any]]]:
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except SyntaxError as exc:
        raise MalformedToolCall(f"not a call list: {exc.msg}") from None
    items = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
    if not items:
        raise MalformedToolCall("an empty call list")
    return [_call(item) for item in items]


def _item_ends(body: str) -> list[int]:
    """Where each item of the list `body` opens closes (just past its last bracket): brackets
    counted outside quoted strings."""
    ends, depth, quote, i = [], 0, "", 0
    while i < len(body):
        c = body[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 1:
                ends.append(i + 1)
            elif depth < 1:
                break
        i += 1
    return ends


def partial(body: str, schemas: Schemas) -> list[tuple[str, dict[str, Any]]]:
    """The calls complete in a call list cut short: the longest run of whole items."""
    if not body.lstrip().startswith("["):
        return []
    for end in reversed(_item_ends(body)):
        try:
            return parse(body[:end] + "]", schemas)
        except MalformedToolCall:
            continue
    return []


def grammar(
    tools: Sequence[Mapping[str, Any]], parallel: bool, literal: Callable[[str], str]
) -> str:
    """The JSON form, one call (or several when `parallel`), each a tool's name and arguments
    valid against its parameters."""
    from tensorfold.engine.structured import arguments_schema

    rules = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        head = '{"name": ' + json.dumps(function["name"]) + ', "arguments": '
        schema = json.dumps(arguments_schema(function.get("parameters")))
        rules.append(f'call_{i}: {json.dumps(head)} %json{schema} "}}"')
    calls = 'call ("," call)*' if parallel else "call"
    return "\n".join(
        [
            f'start: {literal(START)} "[" {calls} "]" {literal(END)}',
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            *rules,
        ]
    )


FORMAT = ToolCallFormat("lfm2", START, END, parse, grammar=grammar, partial=partial)
