"""Every real chat template in tests/data/chat_templates renders tools, assistant tool calls and
tool messages exactly as transformers 5.23.0's apply_chat_template does."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from tensorfold.family.chat_template import ChatTemplateError, render_chat
from tensorfold.server.tool_request import tool_history
from tensorfold.tool_testing import REPO, TEMPLATES, real_template

NAMES = (
    "LFM2-8B-A1B.jinja",
    "LFM2.5-8B-A1B.jinja",
    "google-gemma-4-31B-it.jinja",
    "GLM-4.7-Flash.jinja",
)
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, for some days.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name"},
                    "units": {"type": "string", "enum": ["C", "F"]},
                    "days": {"type": "integer"},
                    "where": {
                        "type": "object",
                        "properties": {"lat": {"type": "number"}},
                        "required": ["lat"],
                    },
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
CALL_ARGS = '{"city": "Paris", "days": 3, "where": {"lat": 48.85}, "tags": ["a", "b"]}'


def history() -> list[dict[str, Any]]:
    """A chat as an OpenAI client sends it: arguments as JSON text, two parallel calls, the two
    tool answers (one as text parts), then the model's answer and a new question."""
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": CALL_ARGS},
        },
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris, and the time?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "10:42"},
        {"role": "assistant", "content": "It is sunny and 21C in Paris; it is 10:42."},
        {"role": "user", "content": "Thanks!"},
    ]


CASES = {
    "tools, one question": lambda: [{"role": "user", "content": "Weather in Paris?"}],
    "history with calls": history,
    "history ending on tool answers": lambda: history()[:5],
    "no system message": lambda: history()[1:],
}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]")).save(
        str(path)
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **SPECIALS)


def test_the_templates_are_test_data_of_the_repository() -> None:
    """The real templates live inside the repository, each one named in the README beside
    them with its source and licence; nothing reads a folder outside the repository."""
    assert TEMPLATES.is_dir() and TEMPLATES.is_relative_to(REPO), TEMPLATES
    assert sorted(p.name for p in TEMPLATES.glob("*.jinja")) == sorted(NAMES)
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    for name in NAMES:
        assert f"`{name}`" in readme, name


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("name", NAMES)
def test_renders_as_transformers(name: str, case: str, gen: bool, hf_tokenizer: Any) -> None:
    template = real_template(name)
    messages = tool_history(CASES[case]())  # arguments as objects, as the server passes them
    hf_tokenizer.chat_template = template
    try:
        theirs = hf_tokenizer.apply_chat_template(
            messages, tools=TOOLS, tokenize=False, add_generation_prompt=gen
        )
    except Exception as exc:  # a template that refuses these messages must refuse them here too
        with pytest.raises(ChatTemplateError):
            render_chat(template, messages, tools=TOOLS, add_generation_prompt=gen, **SPECIALS)
        pytest.skip(f"{name} refuses the case ({type(exc).__name__}: {exc}), here as there")
    ours = render_chat(template, messages, tools=TOOLS, add_generation_prompt=gen, **SPECIALS)
    assert ours.text == theirs
    if case != "tools, one question":
        assert "Let me check." in ours.text and "10:42" in ours.text


def test_the_markup_of_each_template_appears() -> None:
    """The rendered history carries each format's markup: a check that the tools and calls reached
    the template at all, not just that both renderers agree."""
    marks = {
        "LFM2-8B-A1B.jinja": ("<|tool_list_start|>", "<|tool_response_start|>10:42"),
        "LFM2.5-8B-A1B.jinja": ("<|tool_call_start|>[get_weather(city='Paris', days=3",),
        "google-gemma-4-31B-it.jinja": (
            "<|tool>declaration:get_weather",
            "<|tool_call>call:get_time{}<tool_call|>",
        ),
        "GLM-4.7-Flash.jinja": (
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
            "<tool_response>10:42</tool_response>",
        ),
    }
    for name, wanted in marks.items():
        text = render_chat(
            real_template(name), tool_history(history()), tools=TOOLS, **SPECIALS
        ).text
        for piece in wanted:
            assert piece in text, (name, piece)
