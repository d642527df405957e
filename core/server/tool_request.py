"""The request side of tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
checked, and a chat history's assistant `tool_calls` made ready for a chat template.

- `tool_choice` "none" (the default without tools): the tools are not offered to the model (not
  passed to the template, as vLLM does) and its text is not parsed for calls.
- "auto" (the default with tools): the tools go to the template, the reply is parsed.
- "required" and a named function: the tools (a named choice: only that one) go to the template
  and the reply is parsed as with "auto"; where the family's format gives a grammar
  (ToolCallFormat.grammar), decoding is constrained to calls whose arguments validate
  (tensorfold.engine.structured); elsewhere nothing forces a call, and a reply with no call comes back
  as content with finish_reason "stop".
- parallel_tool_calls=false: the first call is returned, later ones are dropped.
- Each tool's `parameters` is compiled as a JSON schema (llguidance, strict mode applied where
  the tool asks for it) whatever tool_choice and the family: a schema that does not compile is
  refused naming tools[i].function.parameters, in every family alike.

Every refusal is a ToolRequestError naming the field and what would be accepted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..engine.structured import StructuredError, check_tool_parameters

if TYPE_CHECKING:
    from ..family.tool_calls import ToolCallFormat

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CHOICE_SHAPE = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
_TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tool calls, once checked. `tools`: what the template is given;
    `format`: the family's markup, which the reply is parsed for."""

    format: ToolCallFormat
    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or "named"
    name: str | None = None  # the named function
    parallel: bool = True


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ToolRequestError(f"{where} must be an object {_TOOL_SHAPE}", "tools")
    if tool.get("type") != "function":
        raise ToolRequestError(
            f'{where}.type must be "function" (the only tool type served), got '
            f"{json.dumps(tool.get('type'))}",
            "tools",
        )
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where}.function must be an object {_TOOL_SHAPE}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolRequestError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', got "
            f"{json.dumps(name)[:80]}",
            "tools",
        )
    for key, kind, words in (
        ("description", str, "a string"),
        ("parameters", dict, "an object"),
        ("strict", bool, "a boolean"),
    ):
        value = function.get(key)
        if value is not None and not isinstance(value, kind):
            raise ToolRequestError(f"{where}.function.{key} must be {words}", "tools")
    return name


def parse_tool_request(
    body: Mapping[str, Any], family: str, fmt: ToolCallFormat | None
) -> ToolRequest | None:
    """The request's tool fields, checked; None when no tools are offered to the model (none
    given, or tool_choice "none")."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ToolRequestError(f"tools must be an array of {_TOOL_SHAPE}", "tools")
    tools = tools or []
    names = [_check_tool(tool, i) for i, tool in enumerate(tools)]
    for i, tool in enumerate(tools):  # the same answer whatever the family and tool_choice
        try:
            check_tool_parameters(tool, i)
        except StructuredError as exc:
            raise ToolRequestError(str(exc), exc.param) from None
    doubled = sorted({n for n in names if names.count(n) > 1})
    if doubled:
        raise ToolRequestError(f"tools name {', '.join(doubled)} more than once", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolRequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    name = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise ToolRequestError(f"tool_choice must be {_CHOICE_SHAPE}", "tool_choice")
        if name not in names:
            listed = ", ".join(names) or "none"
            raise ToolRequestError(
                f"tool_choice names the function {name!r}, which tools does not offer "
                f"(offered: {listed})",
                "tool_choice",
            )
        choice = "named"
    elif choice not in CHOICES:
        raise ToolRequestError(
            f"tool_choice must be {_CHOICE_SHAPE}, got {json.dumps(choice)[:80]}", "tool_choice"
        )
    if choice == "required" and not tools:
        raise ToolRequestError('tool_choice "required" needs tools to choose from', "tool_choice")
    if choice == "none" or not tools:
        return None
    if fmt is None:
        raise ToolRequestError(
            f"the {family} family declares no tool-call format, so tools cannot be served; "
            'leave tools out or send tool_choice "none"',
            "tools",
        )
    offered = [t for t in tools if name is None or t["function"]["name"] == name]
    return ToolRequest(fmt, offered, choice, name, parallel is not False)


def _arguments(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value) if value.strip() else {}
        except ValueError as exc:
            raise ToolRequestError(f"{where} is not valid JSON: {exc}", "messages") from None
        if isinstance(parsed, dict):
            return parsed
    raise ToolRequestError(f"{where} must be a JSON object (or its text)", "messages")


def tool_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each assistant tool call's `arguments` as an object, as chat templates
    read them (vLLM does the same); refuses malformed tool calls and tool messages."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "tool" and not isinstance(message.get("tool_call_id", ""), str):
            raise ToolRequestError(f"messages[{i}].tool_call_id must be a string", "messages")
        if calls is None or calls == []:  # an empty list is no calls (templates test presence)
            out.append({k: v for k, v in message.items() if k != "tool_calls"})
            continue
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise ToolRequestError(
                f"messages[{i}].tool_calls must be an array, on an assistant message", "messages"
            )
        fixed = []
        for j, call in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ToolRequestError(
                    f'{where} must be {{"id": ..., "type": "function", "function": {{"name": '
                    '..., "arguments": "{...}"}}',
                    "messages",
                )
            if call.get("type", "function") != "function":
                raise ToolRequestError(f'{where}.type must be "function"', "messages")
            arguments = _arguments(function.get("arguments", {}), f"{where}.function.arguments")
            fixed.append(
                {**call, "type": "function", "function": {**function, "arguments": arguments}}
            )
        out.append({**message, "tool_calls": fixed})
    return out
