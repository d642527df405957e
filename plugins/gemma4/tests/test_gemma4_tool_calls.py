"""Gemma 4 tool calls: the parser reads what Gemma 4's real template (and the demo's own) renders
for an assistant's calls, whole and streamed in pieces of every size."""

from __future__ import annotations

import pytest

from tensorfold.family.chat_template import render_chat
from tensorfold.family.plugins import family_plugin_manager
from tensorfold.tool_testing import (
    NAMED_WEATHER,
    assert_constrained_calls_validate,
    assistant_part,
    calls_history,
    parse_everywhere,
    real_template,
)
from tensorfold_gemma4.demo_template import CHAT_TEMPLATE
from tensorfold_gemma4.plugin import GEMMA4
from tensorfold_gemma4.tool_calls import FORMAT

S, E, Q = FORMAT.start, FORMAT.end, '<|"|>'
ARGS = {
    "city": "Saint-Étienne, {FR}",
    "days": 3,
    "ratio": -0.5,
    "metric": True,
    "tags": ["a", "b,c"],
    "opts": {"deep": [1, {"x": False}]},
}
CALLS = [("get_weather", ARGS), ("get_time", {})]


def test_the_hook_answers_with_the_format() -> None:
    hooks = family_plugin_manager(GEMMA4, []).hook
    assert hooks.tool_call_format(config={}) is FORMAT


def test_one_call_whole_and_streamed() -> None:
    text = f"{S}call:get_weather{{city:{Q}Paris{Q},days:3}}{E}<|tool_response>"
    assert parse_everywhere(FORMAT, text) == ("", [("get_weather", {"city": "Paris", "days": 3})])


def test_parallel_calls() -> None:
    text = f"{S}call:get_weather{{city:{Q}Paris{Q}}}{E}{S}call:get_time{{}}{E}<|tool_response>"
    want = [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_everywhere(FORMAT, text) == ("", want)
    assert parse_everywhere(FORMAT, text, parallel=False) == ("", want[:1])


def test_text_before_a_call_and_quoted_keys() -> None:
    text = f"Let me check.\n{S}call:get_time{{{Q}zone{Q}:{Q}UTC{Q}, dst : null}}{E}"
    assert parse_everywhere(FORMAT, text) == (
        "Let me check.",
        [("get_time", {"zone": "UTC", "dst": None})],
    )


@pytest.mark.parametrize(
    "body",
    [
        f"get_weather{{city:{Q}Paris{Q}}}",  # no call:
        f"call:get_weather{{city:{Q}Paris}}",  # unclosed string
        "call:get_weather{city:Paris}",  # a bare word is not a value
        "call:get_weather{city:1,}",  # a dangling comma
        "call:{}",  # no name
        "call:f{} trailing",
    ],
)
def test_malformed_markup_is_left_as_content(body: str) -> None:
    text = f"Sure. {S}{body}{E}"
    assert parse_everywhere(FORMAT, text) == (text, [])


def test_an_unclosed_section_is_content() -> None:
    text = f"{S}call:get_time{{zone:{Q}UT"
    assert parse_everywhere(FORMAT, text) == (text, [])


def test_reads_what_the_real_gemma4_template_writes() -> None:
    template = real_template("google-gemma-4-31B-it.jinja")
    text = render_chat(template, calls_history(CALLS, ""), bos_token="<bos>").text
    assert parse_everywhere(FORMAT, assistant_part(text, S, E)) == ("", CALLS)


def test_reads_what_the_demo_template_writes() -> None:
    text = render_chat(CHAT_TEMPLATE, calls_history(CALLS, "Checking."), bos_token="<bos>").text
    assert parse_everywhere(FORMAT, assistant_part(text, "Checking.", E)) == ("Checking.", CALLS)


def test_the_demo_template_names_a_tool_answer_by_its_call() -> None:
    messages = [
        *calls_history(CALLS, ""),
        {"role": "tool", "tool_call_id": "call_1", "content": "10:42"},
    ]
    text = render_chat(CHAT_TEMPLATE, messages, bos_token="<bos>", add_generation_prompt=False).text
    assert text.endswith(f"<|tool_response>response:get_time{{value:{Q}10:42{Q}}}<tool_response|>")


CONSTRAINED = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "units": {"type": "string", "enum": ["C", "F"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "where": {
                        "type": "object",
                        "properties": {
                            "lat": {"type": "number", "minimum": -90, "maximum": 90},
                            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}},
                        },
                    },
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["CET", "UTC"]}, "exact": {"type": "boolean"}},
            },
        },
    },
]


def test_constrained_calls_from_the_random_demo_validate(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """tool_choice required / named on the gemma4 demo (random weights): the grammar alone
    makes the reply one call in Gemma's markup whose arguments validate against the schema; an
    invalid schema is refused naming it, with tool_choice auto too."""
    from tensorfold.engine.sampling import SamplingParams
    from tensorfold.server.tool_request import ToolRequestError
    from tensorfold.testing import close_even, open_llm

    llm = open_llm(
        "gemma4", None, parallel=2, demo_cache=tmp_path_factory.mktemp("gemma-constrained")
    )
    try:
        choices = [
            ("required", SamplingParams(temperature=0, max_tokens=300)),
            ("required", SamplingParams(temperature=1.0, seed=4, max_tokens=300)),
            # seed 6: a call with the nested object and its array, closed within 300 tokens
            (NAMED_WEATHER, SamplingParams(temperature=1.0, seed=6, max_tokens=300)),
        ]
        assert_constrained_calls_validate(llm, CONSTRAINED, choices)
        ask = [[{"role": "user", "content": "What is the weather in Paris?"}]]
        bad = [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}},
                },
            }
        ]
        with pytest.raises(ToolRequestError, match=r"tools\[0\]\.function\.parameters"):
            llm.chat(ask, SamplingParams(max_tokens=4), tools=bad, tool_choice="auto")
    finally:
        close_even(llm)
