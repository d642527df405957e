"""Structured output against a real `tensorfold serve` of the demo (lfm2_moe, random weights),
with the official openai client: response_format json_schema and json_object, guided_regex and
structured_outputs through extra_body, tool_choice required / named, streamed == whole; a
malformed schema, regex or grammar is a 400 naming its field, and the server keeps serving."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from test_server import ServedDemo, served
from test_server_bad_input import Http, check_error
from test_structured import ASK, SCHEMAS, TIME, WEATHER, schema_format

MODEL = "lfm2_moe-demo"
HOSTILE_REGEX = "((a{100}){100}){100}"  # a million a's: past llguidance's lexer budget
BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
INTERNALS = ("<state>", "Tokens:", "grm_prefix", "non-verbose")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    # random weights drawn in place: the grammar, not the model, must make the output valid
    yield from served(tmp_path_factory, "structured", "--parallel", "2", "--load-format", "dummy")


def chat(server: ServedDemo, **kw: Any) -> Any:
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 160, "temperature": 1.0, "seed": 4, **kw}
    return server.client().chat.completions.create(**kw)


def merged_calls(deltas: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(name, arguments) of each streamed call, its delta pieces joined by index as a client
    joins them."""
    by_index: dict[int, list[str]] = {}
    for d in deltas:
        call = by_index.setdefault(d["index"], ["", ""])
        call[0] += d["function"]["name"] or ""
        call[1] += d["function"]["arguments"] or ""
    return [(by_index[i][0], by_index[i][1]) for i in sorted(by_index)]


def streamed(server: ServedDemo, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    text, calls, finish = "", [], None
    for chunk in chat(server, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += [t.model_dump() for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    return text, calls, finish


@pytest.mark.parametrize("name", ["nested", "array_enum"])
def test_json_schema_whole_and_streamed(server: ServedDemo, name: str) -> None:
    fmt = schema_format(SCHEMAS[name])
    whole = chat(server, response_format=fmt).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), SCHEMAS[name])
    text, _, finish = streamed(server, response_format=fmt)
    assert (text, finish) == (whole.message.content, "stop")


def test_json_object_regex_and_structured_outputs(server: ServedDemo) -> None:
    out = chat(
        server,
        response_format={"type": "json_object"},
        temperature=0,
        messages=[{"role": "user", "content": "Tell me a story."}],
    ).choices[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.message.content), dict)
    pattern = r"[A-Z][a-z]{2,5} [0-9]{1,2}"
    out = chat(server, extra_body={"guided_regex": pattern}).choices[0]
    assert re.fullmatch(pattern, out.message.content), out.message.content
    done = server.client().completions.create(
        model=MODEL,
        prompt="Answer:",
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["left", "right"]}},
    )
    assert done.choices[0].text in ("left", "right")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_tool_calls_validate(server: ServedDemo, stream: bool) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = {"tools": [WEATHER, TIME], "tool_choice": choice}
        if stream:
            text, deltas, finish = streamed(server, **kw)
            assert text == "" and finish == "tool_calls"
            calls = merged_calls(deltas)
        else:
            message = chat(server, **kw).choices[0]
            assert message.finish_reason == "tool_calls" and not message.message.content
            calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls]
        assert calls
        for name, arguments in calls:
            if isinstance(choice, dict):
                assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize(
    "fields, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
        ({"structured_outputs": {"json": {"type": 3}}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        (
            {
                "response_format": {"type": "json_object"},
                "tool_choice": "required",
                "tools": [WEATHER],
            },
            "tool_choice",
        ),
        ({"guided_regex": HOSTILE_REGEX}, "guided_regex"),
        *[
            ({"tools": [WEATHER, BAD_TOOL], **choice}, "tools[1].function.parameters")
            for choice in (
                {},
                {"tool_choice": "auto"},
                {"tool_choice": "required"},
                {"tool_choice": "none"},
            )
        ],
    ],
)
def test_malformed_constraints_are_400s_and_serving_goes_on(
    server: ServedDemo, fields: dict[str, Any], param: str
) -> None:
    api = Http(server.base)
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    error = check_error(api.post("/v1/chat/completions", json=body), 400, param)
    assert len(error["message"]) > 20
    assert not any(word in error["message"] for word in INTERNALS), error["message"]
    with pytest.raises(openai.BadRequestError):
        chat(server, extra_body=fields)
    assert chat(server, max_tokens=2).choices[0].finish_reason == "length"


def test_an_expensive_grammar_is_a_400_while_another_stream_streams(server: ServedDemo) -> None:
    """The hostile regex is compiled while its request is parsed (a request worker, llguidance
    letting the GIL go), not at the engine's first mask: a stream already running kept
    streaming while it was refused, and the refusal is a 400 naming the field."""
    arrived: list[int] = []
    first = threading.Event()
    answered = threading.Event()

    def stream() -> None:
        # closed on leaving: the server then cancels it, and its stop does not wait for it
        with chat(server, stream=True, max_tokens=3000, extra_body={"ignore_eos": True}) as s:
            for chunk in s:
                arrived.append(len(chunk.choices))
                first.set()
                if answered.is_set():
                    break

    runner = threading.Thread(target=stream)
    runner.start()
    try:
        assert first.wait(120)
        before = len(arrived)
        body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "guided_regex": HOSTILE_REGEX}
        error = check_error(
            Http(server.base).post("/v1/chat/completions", json=body), 400, "guided_regex"
        )
        during = len(arrived) - before
    finally:
        answered.set()
        runner.join(120)
    assert "budget" in error["message"]
    assert during > 0, "the other stream stopped while the grammar compiled"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_calls_cut_by_max_tokens_keep_their_complete_calls(
    server: ServedDemo, stream: bool
) -> None:
    """tool_choice required, parallel calls, max_tokens too small for the list: finish_reason
    "length", the calls completed before the cut in tool_calls (each valid), no markup in
    content; streamed as whole."""
    kw = {"tools": [TIME], "tool_choice": "required", "max_tokens": 60, "seed": 7}
    if stream:
        text, deltas, finish = streamed(server, **kw)
        calls = merged_calls(deltas)
    else:
        choice = chat(server, **kw).choices[0]
        text, finish = choice.message.content or "", choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert finish == "length" and text == "", text
    assert calls, "no complete call before the cut"
    for name, arguments in calls:
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), TIME["function"]["parameters"])
