"""LFM2 / LFM2.5 tool calls: the parser reads what Liquid's models write and what LFM2.5's real
template (and the demo's own) renders, whole and streamed in pieces of every size."""

from __future__ import annotations

import pytest

from tensorfold.chat_template import render_chat
from tensorfold.plugins import family_plugin_manager
from tensorfold.tool_calls import ToolCallStream
from tensorfold.tool_testing import parse_everywhere, real_template
from tensorfold_lfm2_moe.demo_template import CHAT_TEMPLATE
from tensorfold_lfm2_moe.plugin import LFM2_MOE
from tensorfold_lfm2_moe.tool_calls import FORMAT

S, E = FORMAT.start, FORMAT.end
ARGS = {"city": "Saint-Étienne", "days": 3, "ratio": -0.5, "metric": True, "note": None,
        "tags": ["a", "b'c"], "opts": {"deep": [1, {"x": False}]}}
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
        "Let me look that up.\nOne moment.", [("get_time", {"zone": "UTC"})])


def test_json_form() -> None:
    text = f'{S}[{{"name": "get_time", "arguments": {{"zone": "UTC", "dst": true}}}}]{E}'
    assert parse_everywhere(FORMAT, text) == ("", [("get_time", {"zone": "UTC", "dst": True})])


@pytest.mark.parametrize("body", [
    "[get_weather('Paris')]",  # positional
    "[get_weather(city=]",  # syntax
    "[get_weather(city=open('x'))]",  # not a literal: never evaluated
    "[]", "[42]", "[f(**kw)]",
])
def test_malformed_markup_is_left_as_content(body: str) -> None:
    text = f"Sure. {S}{body}{E}"
    assert parse_everywhere(FORMAT, text) == (text, [])


def test_an_unclosed_section_is_content() -> None:
    text = f"Sure. {S}[get_weather(city='Pa"
    assert parse_everywhere(FORMAT, text) == (text, [])


def test_a_partial_marker_is_held_back_then_released() -> None:
    stream = ToolCallStream(FORMAT)
    assert stream.feed("a <|tool_c").content == "a"
    assert stream.feed("at").content == " <|tool_cat"
    assert stream.finish().content == ""


def _assistant_part(rendered: str, content: str) -> str:
    part = rendered[rendered.index(content):]
    return part[:part.rindex(E) + len(E)]


def _history(content: str) -> list[dict]:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
             for i, (n, a) in enumerate(CALLS)]
    return [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": content, "tool_calls": calls}]


def test_reads_what_the_real_lfm25_template_writes() -> None:
    template = real_template("LFM2.5-8B-A1B.jinja")
    text = render_chat(template, _history("Checking."), bos_token="<|startoftext|>").text
    assert parse_everywhere(FORMAT, _assistant_part(text, "Checking.")) == ("Checking.", CALLS)


def test_reads_what_the_demo_template_writes() -> None:
    text = render_chat(CHAT_TEMPLATE, _history("Checking."), bos_token="<|startoftext|>").text
    assert parse_everywhere(FORMAT, _assistant_part(text, "Checking.")) == ("Checking.", CALLS)


def test_the_offline_chat_takes_tools(tmp_path) -> None:
    from tensorfold.llm import LLM
    from tensorfold.sampling import SamplingParams
    from tensorfold.testing import close_even
    from tensorfold.tool_request import ToolRequestError, tool_history
    from tensorfold_lfm2_moe.demo import build_demo

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    llm = LLM(family="lfm2_moe", model=build_demo(tmp_path), device="cpu", dtype="float32",
              memory_limit_gib=0.25, context=2048, parallel=2)
    try:
        tok = llm.tokenizer

        def prompt(offered):
            return tok.encode(render_chat(CHAT_TEMPLATE, tool_history(chat), tools=offered,
                                          bos_token=tok.bos_token, eos_token=tok.eos_token).text)

        greedy = SamplingParams(temperature=0, max_tokens=4)
        auto, none = llm.chat([chat, chat], [greedy, greedy], tools=tools)[0], llm.chat(
            [chat], greedy, tools=tools, tool_choice="none")[0]
        assert auto.prompt_token_ids == prompt(tools) and none.prompt_token_ids == prompt(None)
        assert auto.prompt_token_ids != none.prompt_token_ids
        for done in (auto, none):  # random weights: no call, the text is the content
            assert done.tool_calls == [] and done.content == done.text
        with pytest.raises(ToolRequestError, match="needs tools"):
            llm.chat([chat], greedy, tool_choice="required")
    finally:
        close_even(llm)
