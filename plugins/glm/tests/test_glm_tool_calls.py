"""GLM tool calls (GLM-4.7-Flash's published format): the parser reads what GLM-4.7-Flash's real
template (and the demo's own) renders for an assistant's calls, whole and streamed in pieces of
every size; string values are typed by the tool's schema."""

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
from tensorfold_glm.demo_text import CHAT_TEMPLATE
from tensorfold_glm.plugin import GLM5_NEXT
from tensorfold_glm.tool_calls import FORMAT

S, E = FORMAT.start, FORMAT.end
ARGS = {
    "city": "Saint-Étienne",
    "zip": "42000",
    "days": 3,
    "ratio": -0.5,
    "metric": True,
    "tags": ["a", "b"],
    "opts": {"deep": [1, {"x": False}]},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                },
            },
        },
    }
]
CALLS = [("get_weather", ARGS), ("get_time", {})]


def pair(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"


def test_the_hook_answers_with_the_format() -> None:
    hooks = family_plugin_manager(GLM5_NEXT, []).hook
    assert hooks.tool_call_format(config={}) is FORMAT


def test_one_call_typed_by_the_schema() -> None:
    text = f"{S}get_weather{pair('city', 'Paris')}{pair('zip', '42000')}{pair('days', '3')}{E}"
    want = [("get_weather", {"city": "Paris", "zip": "42000", "days": 3})]
    assert parse_everywhere(FORMAT, text, TOOLS) == ("", want)
    # without a schema a value is JSON when it reads as JSON
    assert parse_everywhere(FORMAT, text)[1] == [
        ("get_weather", {"city": "Paris", "zip": 42000, "days": 3})
    ]


def test_parallel_calls_with_glm45_newlines() -> None:
    text = f"{S}get_weather\n{pair('city', 'Paris')}\n{E}\n{S}get_time\n{pair('zone', 'CET')}\n{E}"
    want = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert parse_everywhere(FORMAT, text, TOOLS) == ("", want)
    assert parse_everywhere(FORMAT, text, TOOLS, parallel=False) == ("", want[:1])


def test_text_before_a_call() -> None:
    text = f"Let me check the weather.\n{S}get_time{E}"
    assert parse_everywhere(FORMAT, text) == ("Let me check the weather.", [("get_time", {})])


@pytest.mark.parametrize(
    "body",
    [
        f"{pair('city', 'Paris')}",  # no name
        f"get weather{pair('city', 'Paris')}",  # not one name
        "get_weather<arg_key>city</arg_key>",  # a key without a value
        f"get_weather{pair('city', 'Paris')} stray",
    ],
)
def test_malformed_markup_is_left_as_content(body: str) -> None:
    text = f"Sure. {S}{body}{E}"
    assert parse_everywhere(FORMAT, text, TOOLS) == (text, [])


def test_an_unclosed_section_is_content() -> None:
    text = f"{S}get_weather<arg_key>ci"
    assert parse_everywhere(FORMAT, text, TOOLS) == (text, [])


def test_reads_what_the_real_glm47_template_writes() -> None:
    template = real_template("GLM-4.7-Flash.jinja")
    text = render_chat(template, calls_history(CALLS, "Checking."), tools=TOOLS).text
    assert parse_everywhere(FORMAT, assistant_part(text, "Checking.", E), TOOLS) == (
        "Checking.",
        CALLS,
    )


def test_reads_what_the_demo_template_writes() -> None:
    text = render_chat(CHAT_TEMPLATE, calls_history(CALLS, "Checking."), tools=TOOLS).text
    assert parse_everywhere(FORMAT, assistant_part(text, "Checking.", E), TOOLS) == (
        "Checking.",
        CALLS,
    )


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
                    "hours": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 23},
                        "maxItems": 3,
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
                "properties": {"zone": {"enum": ["CET", "UTC"]}},
                "required": ["zone"],
            },
        },
    },
]


def test_constrained_calls_from_the_random_demo_validate(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """tool_choice required / named on the glm5_next demo (random weights): the grammar alone
    makes the reply one call in GLM's markup whose arguments validate against the schema."""
    from tensorfold.engine.sampling import SamplingParams
    from tensorfold.testing import close_even, open_llm

    llm = open_llm(
        "glm5_next", None, parallel=2, demo_cache=tmp_path_factory.mktemp("glm-constrained")
    )
    try:
        choices = [
            ("required", SamplingParams(temperature=0, max_tokens=400)),
            (NAMED_WEATHER, SamplingParams(temperature=1.0, seed=8, max_tokens=400)),
        ]
        assert_constrained_calls_validate(llm, CONSTRAINED, choices)
    finally:
        close_even(llm)
