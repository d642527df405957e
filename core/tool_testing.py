"""Test helpers for tool-call formats (the core's tests and each family's): feed a format's
stream in pieces of many sizes, rebuild the calls from the OpenAI deltas as a client does, and
find the real chat templates kept as test data in the repository (tests/data/chat_templates)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

from .family.tool_calls import ToolCallFormat, ToolCallStream, parse_tool_calls

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "tests" / "data" / "chat_templates"
SIZES = (1, 2, 3, 5, 8, 13, 10_000)


def real_template(name: str) -> str:
    """A real chat template from the repository's test data (TEMPLATES); skips the test, saying
    where the file is expected, when it is absent (an installed package without the tests)."""
    import pytest

    path = TEMPLATES / name
    if not path.is_file():
        pytest.skip(
            f"{path} is absent: the real chat templates are test data of a source "
            "checkout (tests/data/chat_templates); run the tests from one"
        )
    return path.read_text(encoding="utf-8")


def calls_from_deltas(deltas: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Rebuild (name, arguments) from `delta.tool_calls` items, as OpenAI's client merges them
    by index; checks that each call opens with its id and name before any argument text."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        index = delta["index"]
        if index not in calls:
            assert delta["id"].startswith("call_") and delta["type"] == "function", delta
            assert delta["function"]["name"], delta
            calls[index] = {"name": delta["function"]["name"], "arguments": ""}
        else:
            assert "id" not in delta and "name" not in delta["function"], delta
        calls[index]["arguments"] += delta["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [(c["name"], json.loads(c["arguments"])) for c in calls.values()]


def stream_in_pieces(
    fmt: ToolCallFormat,
    text: str,
    size: int,
    tools: Sequence[Mapping[str, Any]] = (),
    parallel: bool = True,
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """Feed `text` `size` characters at a time; the content and calls a client would see."""
    stream = ToolCallStream(fmt, tools, parallel=parallel)
    content, deltas = "", []
    for at in range(0, len(text), size):
        piece = stream.feed(text[at : at + size])
        content += piece.content
        deltas += piece.deltas
    piece = stream.finish()
    return content + piece.content, calls_from_deltas(deltas + piece.deltas)


def parse_everywhere(
    fmt: ToolCallFormat, text: str, tools: Sequence[Mapping[str, Any]] = (), parallel: bool = True
) -> tuple[str, list[tuple[str, dict[str, Any]]]]:
    """The text parsed whole, checked equal to the text streamed in pieces of every size in
    SIZES (one character at a time included); returns (content, [(name, arguments)])."""
    content, calls = parse_tool_calls(fmt, text, tools, parallel=parallel)
    whole = [(c.name, json.loads(c.arguments)) for c in calls]
    for size in SIZES:
        assert stream_in_pieces(fmt, text, size, tools, parallel) == (content, whole), size
    return content, whole


def calls_history(calls: Sequence[tuple[str, dict[str, Any]]], content: str) -> list[dict]:
    """A user's question and an assistant turn with `content` and `calls` (name, arguments),
    the calls named call_0, call_1, ... in the OpenAI shape a chat template renders."""
    tool_calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)
    ]
    return [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": content, "tool_calls": tool_calls},
    ]


def assistant_part(rendered: str, first: str, end: str) -> str:
    """A rendered chat from the assistant turn's `first` text to its last call's `end` marker."""
    part = rendered[rendered.index(first) :]
    return part[: part.rindex(end) + len(end)]


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def assert_constrained_calls_validate(
    llm: Any, tools: Sequence[Mapping[str, Any]], choices: Sequence[tuple[Any, Any]]
) -> None:
    """For each (tool_choice, SamplingParams) of `choices` ("required", or a named choice such
    as NAMED_WEATHER), a question about the weather in Paris with `tools` offered on `llm`:
    the grammar alone makes the reply one call (no content) whose arguments validate against
    its tool's schema, the named tool when one is named."""
    import json

    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    ask = [[{"role": "user", "content": "What is the weather in Paris?"}]]
    for choice, params in choices:
        out = llm.chat(ask, params, tools=tools, tool_choice=choice, parallel_tool_calls=False)[0]
        assert out.finish_reason == "tool_calls" and out.content is None, out.text
        (call,) = out.tool_calls
        if isinstance(choice, Mapping):
            assert call.name == choice["function"]["name"]
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
