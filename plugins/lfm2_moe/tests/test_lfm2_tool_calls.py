"""LFM2 / LFM2.5 tool calls: the parser reads what Liquid's models write and what LFM2.5's real
template (and the demo's own) renders, whole and streamed in pieces of every size; the offline
chat offers tools and parses what a model (here forced token by token) writes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.chat_template import render_chat
from tensorfold.family.plugins import family_plugin_manager
from tensorfold.family.reasoning import split_reasoning
from tensorfold.family.tool_calls import ToolCallStream
from tensorfold.llm import LLM
from tensorfold.server.tool_request import ToolRequestError, tool_history
from tensorfold.testing import close_even
from tensorfold.tool_testing import assistant_part, calls_history, parse_everywhere, real_template
from tensorfold_lfm2_moe.demo import build_demo
from tensorfold_lfm2_moe.demo_template import CHAT_TEMPLATE
from tensorfold_lfm2_moe.plugin import LFM2_MOE
from tensorfold_lfm2_moe.tool_calls import FORMAT

S, E = FORMAT.start, FORMAT.end
ARGS = {
    "city": "Saint-Étienne",
    "days": 3,
    "ratio": -0.5,
    "metric": True,
    "note": None,
    "tags": ["a", "b'c"],
    "opts": {"deep": [1, {"x": False}]},
}
CALLS = [("get_weather", ARGS), ("get_time", {})]


def test_the_hook_answers_with_the_format() -> None:
    hooks = family_plugin_manager(LFM2_MOE, []).hook
    assert hooks.tool_call_format(config={}) is FORMAT


def test_one_call_whole_and_streamed() -> None:
    text = f'{S}[get_weather(city="Paris", days=3)]{E}'
    assert parse_everywhere(FORMAT, text) == ("", [("get_weather", {"city": "Paris", "days": 3})])


def test_parallel_calls_in_one_list_and_in_two_sections() -> None:
    one = f"{S}[get_weather(city='Paris'), get_time(zone=\"CET\")]{E}"
    two = f"{S}[get_weather(city='Paris')]{E}\n{S}[get_time(zone='CET')]{E}\n"
    want = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert parse_everywhere(FORMAT, one) == ("", want)
    assert parse_everywhere(FORMAT, two) == ("", want)
    assert parse_everywhere(FORMAT, one, parallel=False) == ("", want[:1])


def test_text_before_and_after_a_call() -> None:
    text = f"Let me look that up.\n{S}[get_time(zone='UTC')]{E}\nOne moment."
    assert parse_everywhere(FORMAT, text) == (
        "Let me look that up.\nOne moment.",
        [("get_time", {"zone": "UTC"})],
    )


def test_json_form() -> None:
    text = f'{S}[{{"name": "get_time", "arguments": {{"zone": "UTC", "dst": true}}}}]{E}'
    assert parse_everywhere(FORMAT, text) == ("", [("get_time", {"zone": "UTC", "dst": True})])


@pytest.mark.parametrize(
    "body",
    [
        "[get_weather('Paris')]",  # positional
        "[get_weather(city=]",  # syntax
        "[get_weather(city=open('x'))]",  # not a literal: never evaluated
        "[]",
        "[42]",
        "[f(**kw)]",
    ],
)
def test_malformed_markup_is_left_as_content(body: str) -> None:
    text = f"Sure. {S}{body}{E}"
    assert parse_everywhere(FORMAT, text) == (text, [])


def test_an_unclosed_section_is_content() -> None:
    text = f"Sure. {S}[get_weather(city='Pa"
    assert parse_everywhere(FORMAT, text) == (text, [])


@pytest.mark.parametrize(
    "cut, calls",
    [
        ("[get_weather(city='Pa)r", []),
        (
            "[get_weather(city='Pa)ris', days=3), get_ti",
            [("get_weather", {"city": "Pa)ris", "days": 3})],
        ),
        (
            '[{"name": "get_time", "arguments": {"zone": "}"}}, {"name": "get_weather", "argu',
            [("get_time", {"zone": "}"})],
        ),
    ],
    ids=["first", "python", "json"],
)
def test_a_list_cut_by_max_tokens_gives_its_complete_calls(cut: str, calls: list[Any]) -> None:
    text = f"Checking. {S}{cut}"
    for size in (1, 3, len(text)):
        stream = ToolCallStream(FORMAT)
        content = "".join(
            stream.feed(text[i : i + size]).content for i in range(0, len(text), size)
        )
        content += stream.finish(cut=True).content
        assert (
            content == "Checking."
            and [(c.name, json.loads(c.arguments)) for c in stream.calls] == calls
        )


def test_a_partial_marker_is_held_back_then_released() -> None:
    stream = ToolCallStream(FORMAT)
    assert stream.feed("a <|tool_c").content == "a"
    assert stream.feed("at").content == " <|tool_cat"
    assert stream.finish().content == ""


def test_reads_what_the_real_lfm25_template_writes() -> None:
    template = real_template("LFM2.5-8B-A1B.jinja")
    text = render_chat(
        template, calls_history(CALLS, "Checking."), bos_token="<|startoftext|>"
    ).text
    assert parse_everywhere(FORMAT, assistant_part(text, "Checking.", E)) == ("Checking.", CALLS)


def test_reads_what_the_demo_template_writes() -> None:
    text = render_chat(
        CHAT_TEMPLATE, calls_history(CALLS, "Checking."), bos_token="<|startoftext|>"
    ).text
    assert parse_everywhere(FORMAT, assistant_part(text, "Checking.", E)) == ("Checking.", CALLS)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    served = LLM(
        family="lfm2_moe",
        model=build_demo(tmp_path_factory.mktemp("demo")),
        device="cpu",
        dtype="float32",
        memory_limit_gib=0.25,
        context=2048,
        parallel=2,
    )
    yield served
    close_even(served)


def test_the_offline_chat_takes_tools(llm: LLM) -> None:
    tok = llm.tokenizer

    def prompt(offered: list[dict] | None) -> list[int]:
        return tok.encode(
            render_chat(
                CHAT_TEMPLATE,
                tool_history(CHAT),
                tools=offered,
                bos_token=tok.bos_token,
                eos_token=tok.eos_token,
            ).text
        )

    greedy = SamplingParams(temperature=0, max_tokens=4)
    auto = llm.chat([CHAT, CHAT], [greedy, greedy], tools=TOOLS)[0]
    none = llm.chat([CHAT], greedy, tools=TOOLS, tool_choice="none")[0]
    assert auto.prompt_token_ids == prompt(TOOLS) and none.prompt_token_ids == prompt(None)
    assert auto.prompt_token_ids != none.prompt_token_ids
    for done in (auto, none):  # no call: the text is the thinking and the content
        split = split_reasoning(llm.served.reasoning_format, done.text)
        assert done.tool_calls == [] and (done.reasoning_content or "", done.content) == split
    with pytest.raises(ToolRequestError, match="needs tools"):
        llm.chat([CHAT], greedy, tool_choice="required")


@pytest.mark.parametrize("parallel", [True, False])
def test_a_model_forced_to_write_calls_gives_tool_calls(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, parallel: bool
) -> None:
    """The demo's logits are replaced by a script of tokens (its random weights would not call):
    the lanes decode them token by token, and the chat's reply is parsed into calls."""
    tok = llm.tokenizer
    text = f"Let me check.\n{S}[get_weather(city=\"Paris\"), get_weather(city='Lyon')]{E}"
    script = iter([*tok.encode(text), min(tok.eos_token_ids)])
    model = llm.served.engine.lanes.runner.model
    real = model.forward

    def forced(fp: Any, rows: Any, slots: Any) -> torch.Tensor:
        logits = real(fp, rows, slots)
        assert logits.shape[0] == 1  # one stream, one row wanted a pass
        out = torch.full_like(logits, -1e4)
        out[0, next(script)] = 0.0
        return out

    monkeypatch.setattr(model, "forward", forced)
    done = llm.chat(
        [CHAT],
        SamplingParams(temperature=0, max_tokens=400),
        tools=TOOLS,
        parallel_tool_calls=parallel,
    )[0]
    assert done.text == text and done.content == "Let me check."
    assert done.finish_reason == "tool_calls"
    want = [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')]
    assert [(c.name, c.arguments) for c in done.tool_calls] == want[: 2 if parallel else 1]
    assert all(c.id.startswith("call_") for c in done.tool_calls)
