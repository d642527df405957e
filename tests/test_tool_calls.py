"""The core's side of tool calls: the request fields checked, history made ready for templates,
the incremental parser's holding back, and replies (whole and streamed) in OpenAI's shapes, fed
the events the engine would send. A tiny format stands in for a family's."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tensorfold.engine.requests import Finished, TokenOut
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.family.tool_calls import MalformedToolCall, ToolCallFormat, ToolCallStream
from tensorfold.server.openai_api import Parsed
from tensorfold.server.openai_replies import Reply, TokenTexts, sse
from tensorfold.server.tool_request import ToolRequestError, parse_tool_request, tool_history
from tensorfold.tool_testing import calls_from_deltas, parse_everywhere


def _parse(body: str, schemas: Any) -> list[tuple[str, dict[str, Any]]]:
    name, _, args = body.partition(" ")
    if not name.isidentifier():
        raise MalformedToolCall(f"no name in {body!r}")
    arguments = json.loads(args or "{}")
    if not isinstance(arguments, dict):
        raise MalformedToolCall("arguments must be an object")
    return [(name, arguments)]


FMT = ToolCallFormat("test", "<call>", "</call>", _parse, after=("<done>",))
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


# -- the request ---------------------------------------------------------------------------------


def test_tool_choice_defaults_and_what_the_template_is_given() -> None:
    assert parse_tool_request({}, "fam", FMT) is None
    assert parse_tool_request({"tools": []}, "fam", FMT) is None
    assert parse_tool_request({"tools": [TOOL], "tool_choice": "none"}, "fam", FMT) is None
    auto = parse_tool_request({"tools": [TOOL, TIME]}, "fam", FMT)
    assert auto is not None and (auto.choice, auto.tools, auto.parallel) == (
        "auto",
        [TOOL, TIME],
        True,
    )
    named = parse_tool_request(
        {
            "tools": [TOOL, TIME],
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        "fam",
        FMT,
    )
    assert named is not None and (named.choice, named.name, named.tools, named.parallel) == (
        "named",
        "get_time",
        [TIME],
        False,
    )
    required = parse_tool_request({"tools": [TOOL], "tool_choice": "required"}, "fam", FMT)
    assert required is not None and required.choice == "required"
    # tool_choice "none" is served by a family with no format: nothing is offered
    assert parse_tool_request({"tools": [TOOL], "tool_choice": "none"}, "fam", None) is None


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tools": {"a": 1}}, "tools", "tools must be an array"),
        ({"tools": ["get_weather"]}, "tools", "tools[0] must be an object"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools", 'tools[0].type must be "function"'),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0].function must be an object"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools",
            "tools[0].function.name must be 1 to 64",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools",
            "tools[0].function.parameters must be an object",
        ),
        ({"tools": [TOOL, TOOL]}, "tools", "tools name get_weather more than once"),
        (
            {"tools": [TOOL], "tool_choice": "always"},
            "tool_choice",
            'tool_choice must be "none", "auto", "required" or {"type": "function"',
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "names the function 'nope', which tools does not offer (offered: get_weather)",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function"}},
            "tool_choice",
            "tool_choice must be",
        ),
        ({"tool_choice": "required"}, "tool_choice", 'tool_choice "required" needs tools'),
        (
            {"tools": [TOOL], "parallel_tool_calls": "yes"},
            "parallel_tool_calls",
            "parallel_tool_calls must be a boolean",
        ),
    ],
)
def test_bad_tool_fields_are_named(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ToolRequestError) as caught:
        parse_tool_request(body, "fam", FMT)
    assert caught.value.param == param and words in str(caught.value)


def test_a_family_without_a_format_refuses_tools_naming_itself() -> None:
    with pytest.raises(ToolRequestError, match='fam family declares no tool-call format.*"none"'):
        parse_tool_request({"tools": [TOOL]}, "fam", None)


def test_history_arguments_become_objects() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    fixed = tool_history(messages)
    assert fixed[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert fixed[1] == messages[1]
    assert tool_history([{"role": "assistant", "content": "hi", "tool_calls": []}]) == [
        {"role": "assistant", "content": "hi"}
    ]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize(
    "message, words",
    [
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
            },
            "messages[0].tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            "messages[0].tool_calls[0].function.arguments must be a JSON object",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "messages[0].tool_calls[0] must be",
        ),
        (
            {"role": "assistant", "tool_calls": {"function": {}}},
            "messages[0].tool_calls must be an array",
        ),
        ({"role": "user", "tool_calls": [{}]}, "on an assistant message"),
        (
            {"role": "tool", "tool_call_id": 7, "content": "x"},
            "messages[0].tool_call_id must be a string",
        ),
    ],
)
def test_bad_history_is_named(message: dict[str, Any], words: str) -> None:
    with pytest.raises(ToolRequestError, match="messages") as caught:
        tool_history([message])
    assert words in str(caught.value) and caught.value.param == "messages"


# -- the parser's machinery ----------------------------------------------------------------------


def test_whitespace_around_calls_and_the_after_marker() -> None:
    text = 'Hi.\n\n<call>get_weather {"city": "Paris"}</call>\n<call>get_time</call>\n<done>'
    assert parse_everywhere(FMT, text) == (
        "Hi.",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    )
    # text after the calls stays content; a plain answer keeps its trailing whitespace
    assert parse_everywhere(FMT, "<call>get_time</call>\nDone.") == ("\nDone.", [("get_time", {})])
    assert parse_everywhere(FMT, "Just text.\n") == ("Just text.\n", [])
    assert parse_everywhere(FMT, "a <cal") == ("a <cal", [])
    assert parse_everywhere(FMT, "<done> is text without calls") == (
        "<done> is text without calls",
        [],
    )


def test_a_malformed_call_between_good_ones_is_content_and_the_others_are_calls() -> None:
    text = "<call>get_time</call> <call>bad name</call><call>get_time {}</call>"
    assert parse_everywhere(FMT, text) == (
        " <call>bad name</call>",
        [("get_time", {}), ("get_time", {})],
    )


def test_a_parser_that_breaks_leaves_the_section_as_content() -> None:
    def broken(body: str, schemas: Any) -> list[tuple[str, dict[str, Any]]]:
        raise KeyError(body)

    fmt = ToolCallFormat("broken", "<call>", "</call>", broken)
    assert parse_everywhere(fmt, "a <call>x</call>") == ("a <call>x</call>", [])


# -- replies, as the server sends them -----------------------------------------------------------


def _reply(tools: list[dict[str, Any]], **choice: Any) -> Reply:
    request = parse_tool_request({"tools": tools, **choice}, "fam", FMT)
    parsed = Parsed("chat", [1, 2, 3], SamplingParams(max_tokens=64), tools=request)
    return Reply(parsed, "demo", 7, TokenTexts(SimpleNamespace(hf=SimpleNamespace(decoder=None))))


def _events(pieces: list[str], reason: str = "stop") -> list[Any]:
    out: list[Any] = [TokenOut("r", i, i, p, 0.0, []) for i, p in enumerate(pieces)]
    return out + [Finished("r", reason, "", 3, len(pieces), 0, 7)]  # type: ignore[arg-type]


PIECES = [
    "Let",
    " me check.",
    "\n<ca",
    "ll>get_weather ",
    '{"city": "Pa',
    'ris"}</call>',
    "<call>get_time",
    "</call>",
]
WANT = [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_whole_reply_has_tool_calls_and_finish_reason() -> None:
    reply = _reply([TOOL, TIME])
    for event in _events(PIECES):
        reply.add(event)
    body = reply.response()
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message["tool_calls"]
    ] == WANT
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )
    assert len({c["id"] for c in message["tool_calls"]}) == 2


def _stream(reply: Reply, events: list[Any]) -> list[dict[str, Any]]:
    data = b""
    for event in events:
        reply.add(event)
        if event.text:
            data += reply.sse_chunks(event.text, [], 0)
    data += reply.finish() + sse(b"[DONE]")  # a lone choice's stream ends so (Choices.ending)
    lines = [line.removeprefix(b"data: ") for line in data.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    return chunks


def test_streamed_reply_sends_id_and_name_first_then_arguments_and_no_markup() -> None:
    chunks = _stream(_reply([TOOL, TIME]), _events(PIECES))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Let me check."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert all(len(d.get("tool_calls", [])) <= 1 for d in deltas)  # one call piece a chunk
    assert calls_from_deltas(calls) == WANT
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    reply = _reply([TOOL, TIME], parallel_tool_calls=False)
    chunks = _stream(reply, _events(PIECES))
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls_from_deltas(calls) == WANT[:1]


@pytest.mark.parametrize("upto, calls", [(5, []), (7, WANT[:1])], ids=["in-first", "in-second"])
def test_a_reply_cut_by_length_keeps_its_complete_calls_and_no_markup(
    upto: int, calls: list[Any]
) -> None:
    """max_tokens reached inside a call section: finish_reason "length", the calls complete
    before it in tool_calls, no markup in content; whole and streamed alike."""
    cut = _events(PIECES[:upto], "length")
    reply = _reply([TOOL, TIME])
    for event in cut:
        reply.add(event)
    choice = reply.response()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "Let me check."
    got = [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls", [])
    ]
    assert got == calls
    chunks = _stream(_reply([TOOL, TIME]), cut)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
    assert calls_from_deltas([tc for d in deltas for tc in d.get("tool_calls", [])]) == calls
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def _list_parse(body: str, schemas: Any) -> list[tuple[str, dict[str, Any]]]:
    items = json.loads(body)
    return [(item["name"], item["arguments"]) for item in items]


def _list_partial(body: str, schemas: Any) -> list[tuple[str, dict[str, Any]]]:
    head = body[: body.rfind("}}") + 2]
    return _list_parse(head + "]", schemas) if "}}" in head else []


LIST = ToolCallFormat("list", "<calls>", "</calls>", _list_parse, partial=_list_partial)


def test_a_list_section_cut_short_gives_the_calls_it_completed() -> None:
    text = (
        '<calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "argu'
    )
    stream = ToolCallStream(LIST)
    piece = stream.feed(text)
    piece.extend(stream.finish(cut=True))
    assert piece.content == "" and [c.name for c in stream.calls] == ["get_weather"]
    stream = ToolCallStream(LIST)  # not cut (the model stopped): the open section is content
    piece = stream.feed(text)
    piece.extend(stream.finish())
    assert piece.content == text and not stream.calls


def test_without_tools_the_reply_is_untouched() -> None:
    parsed = Parsed("chat", [1], SamplingParams(max_tokens=8))
    reply = Reply(parsed, "demo", 7, TokenTexts(SimpleNamespace(hf=SimpleNamespace(decoder=None))))
    chunks = _stream(reply, _events(PIECES))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "".join(PIECES)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- special-token markers reach the parser -------------------------------------------------------


def test_kept_special_tokens_are_decoded_the_others_skipped() -> None:
    vocab = {"<call>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh Ġ")}}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<call>", "<eos>"])
    tok = Tokenizer(hf, eos_token="<eos>")
    ids = tok.encode("ab <call>cd<eos> ef")
    assert tok.special_ids(["<call>", "</call>"]) == {0}
    assert tok.decode(ids) == "ab cd ef"
    assert tok.decode(ids, keep=frozenset({0})) == "ab <call>cd ef"
    decoder = tok.incremental_decoder(keep=frozenset({0}))
    assert "".join(decoder.step([i]) for i in ids) + decoder.flush() == "ab <call>cd ef"
    with pytest.raises(Exception, match="keep_special_ids"):
        SamplingParams(keep_special_ids=(-1,))


def test_an_end_marker_split_after_a_long_section_is_found() -> None:
    """The search for the end marker resumes where it may still start (not from the section's
    beginning): a marker split across pieces, far into a section, is still found."""
    stream = ToolCallStream(FMT)
    stream.feed('<call>get_weather {"city": "')
    for _ in range(1000):
        stream.feed("abcd")
    for piece in ('"}</c', "al", "l>"):
        stream.feed(piece)
    assert [c.name for c in stream.calls] == ["get_weather"]
    assert json.loads(stream.calls[0].arguments) == {"city": "abcd" * 1000}
