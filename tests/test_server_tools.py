"""Tool fields against a real `tensorfold serve` of the demo (lfm2_moe), with the official openai
client: accepted and checked with named 400s, tools offered to the template or not as tool_choice
says, history with tool calls and tool answers rendered by the demo's template, stream == whole,
the census even at the end. The demo's weights are random, so whether it calls is not asserted
here: the parsing of calls in replies is tested on engine events (tests/test_tool_calls.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_server import ServedDemo

from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.server.tool_request import tool_history

MODEL = "lfm2_moe-demo"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21C"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(tmp_path_factory.mktemp("tools"), "--parallel", "2")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok(server: ServedDemo) -> Tokenizer:
    from tensorfold_lfm2_moe.demo import DEMO_NAME

    return Tokenizer.from_checkpoint(Checkpoint.open(server.tmp / "demo" / DEMO_NAME))


def prompt_tokens(
    tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[int, str]:
    assert tok.chat_template is not None
    text = render_chat(
        tok.chat_template,
        tool_history(messages),
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        tools=tools,
    ).text
    return len(tok.encode(text)), text


def ask(server: ServedDemo, **kw: Any) -> Any:
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 8, "temperature": 0, **kw}
    return server.client().chat.completions.create(**kw)


@pytest.mark.parametrize(
    "choice, offered",
    [
        ("auto", [WEATHER, TIME]),
        (None, [WEATHER, TIME]),
        ("none", None),
        ("required", [WEATHER, TIME]),
        ({"type": "function", "function": {"name": "get_time"}}, [TIME]),
    ],
)
def test_tool_choice_decides_what_the_template_is_given(
    server: ServedDemo, tok: Tokenizer, choice: Any, offered: Any
) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    r = ask(server, tools=[WEATHER, TIME], parallel_tool_calls=False, **extra)
    assert r.usage is not None
    want, text = prompt_tokens(tok, ASK, offered)
    assert r.usage.prompt_tokens == want
    assert ("<|tool_list_start|>" in text) == (offered is not None)
    message = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<|tool_call_start|>" not in (message.content or "")
    for call in message.tool_calls or []:  # should the random weights ever call
        assert call.id.startswith("call_") and isinstance(json.loads(call.function.arguments), dict)


def test_history_with_tool_calls_and_answers_renders(server: ServedDemo, tok: Tokenizer) -> None:
    r = ask(server, messages=HISTORY, tools=[WEATHER])
    want, text = prompt_tokens(tok, HISTORY, [WEATHER])
    assert r.usage is not None and r.usage.prompt_tokens == want
    assert (
        '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>' in text
        and "<|tool_response_start|>sunny, 21C<|tool_response_end|>" in text
    )


def test_stream_with_tools_equals_whole(server: ServedDemo) -> None:
    kw: dict[str, Any] = {"messages": HISTORY, "tools": [WEATHER], "max_tokens": 16}
    whole = ask(server, **kw)
    chunks = list(ask(server, **kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == (whole.choices[0].message.content or "")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"tools": [{"type": "retrieval"}]}, "tools", 'tools[0].type must be "function"'),
        ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
        (
            {"tools": [WEATHER], "tool_choice": "sometimes"},
            "tool_choice",
            '"none", "auto", "required"',
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "tool_choice",
            "offered: get_weather",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "parallel_tool_calls": 1},
            "parallel_tool_calls",
            "must be a boolean",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{bad"},
                            }
                        ],
                    },
                ]
            },
            "messages",
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),
    ],
)
def test_bad_tool_fields_are_400_then_the_server_serves(
    server: ServedDemo, kw: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, **kw)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"]
    assert ask(server).choices[0].finish_reason in ("stop", "length")


def test_census_even_at_the_end(server: ServedDemo) -> None:
    server.wait_even()
