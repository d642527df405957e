"""Reasoning out and in: the thinking splitter (any chunking gives the whole text's split, no
markup ever in content), replies fed the events the engine would send (reasoning_content whole
and streamed, reasoning tokens counted, tool calls after thinking parsed and inside it not),
the request's chat_template_kwargs / reasoning_effort / TF_REASONING reaching the real GLM and
Gemma 4 templates, and the 400s for bad ones."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from tensorfold.cli.commands import parse_args, settings_from_args
from tensorfold.config.settings import Settings, SettingsError
from tensorfold.engine.requests import Finished, TokenOut
from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    split_reasoning,
    starts_inside,
)
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.family.tool_calls import MalformedToolCall, ToolCallFormat
from tensorfold.server.openai_api import ApiError, Parsed, template_kwargs
from tensorfold.server.openai_replies import Choices, Reply, TokenTexts, sse
from tensorfold.server.prompt_work import PromptJob, make_prompt
from tensorfold.server.tool_request import parse_tool_request
from tensorfold.tool_testing import calls_from_deltas, real_template

THINK = ReasoningFormat("think", "<think>", "</think>")
GEMMA = ReasoningFormat("gemma4", "<|channel>thought\n", "<channel|>")


def _split_in_pieces(fmt: ReasoningFormat, text: str, cuts: list[int], inside: bool) -> Any:
    stream = ReasoningStream(fmt, inside)
    reasoning = content = ""
    edges = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    for a, b in zip(edges, edges[1:]):
        out = stream.feed(text[a:b])
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = stream.finish()
    return reasoning + out.reasoning, content + out.content


# -- the splitter --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, text, inside, want",
    [
        (THINK, "Let me see.</think>\n\nIt is 4.", True, ("Let me see.", "It is 4.")),
        (THINK, "<think>hm, 2+2</think>4", False, ("hm, 2+2", "4")),  # LFM2.5 style
        (THINK, "\n<think>hm</think> 4", False, ("hm", "4")),
        (THINK, "It is 4.", False, ("", "It is 4.")),
        (THINK, "still thinking, cut her", True, ("still thinking, cut her", "")),
        (THINK, "<think>cut inside </thi", False, ("cut inside </thi", "")),
        (THINK, "Plain </think> 4", False, ("", "Plain 4")),  # a stray end marker is markup
        (THINK, "a <thin", False, ("", "a <thin")),
        (THINK, "Answer.\n", False, ("", "Answer.\n")),
        (GEMMA, "<|channel>thought\nweigh it<channel|>Paris.", False, ("weigh it", "Paris.")),
        (GEMMA, "<|channel>thought<channel|>x", False, ("", "<|channel>thoughtx")),
    ],
)
def test_split(fmt: ReasoningFormat, text: str, inside: bool, want: tuple[str, str]) -> None:
    assert split_reasoning(fmt, text, inside) == want
    assert _split_in_pieces(fmt, text, list(range(len(text))), inside) == want


# Words a text is made of, cut anywhere (markers split across pieces). No lone "<" or "</":
# one right before a stray end marker, which is dropped, would meet the text after it and spell a
# marker the model never wrote ("<" + "</think>" + "think>").
PIECES = st.lists(
    st.sampled_from(["<think>", "</think>", "think", ">", " ", "\n", "a", "bc", "<t", "</t"]),
    max_size=16,
).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=PIECES, cuts=st.lists(st.integers(0, 200), max_size=8), inside=st.booleans())
def test_any_chunking_gives_the_whole_texts_split_and_no_markup_in_content(
    text: str, cuts: list[int], inside: bool
) -> None:
    whole = split_reasoning(THINK, text, inside)
    assert _split_in_pieces(THINK, text, cuts, inside) == whole
    assert "<think>" not in whole[1] and "</think>" not in whole[1]


@settings(max_examples=100, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(["<|channel>thought\n", "<channel|>", "<|chan", "nel>", "ok", "\n", " "]),
        max_size=12,
    ).map("".join),
    cuts=st.lists(st.integers(0, 200), max_size=8),
)
def test_gemma_markers_split_anywhere(text: str, cuts: list[int]) -> None:
    whole = split_reasoning(GEMMA, text)
    assert _split_in_pieces(GEMMA, text, cuts, False) == whole
    assert GEMMA.start not in whole[1] and GEMMA.end not in whole[1]


def test_a_marker_prefix_is_held_back_until_it_is_known() -> None:
    stream = ReasoningStream(THINK, thinking=True)
    assert (stream.feed("weighing</th").reasoning, stream.inside) == ("weighing", True)
    out = stream.feed("ink>\n Done")
    assert (out.reasoning, out.content, stream.inside, out.thinking) == ("", "Done", False, True)
    assert stream.feed(" now").thinking is False


def test_the_prompt_says_where_the_reply_starts() -> None:
    assert starts_inside(THINK, "<|user|>hi<|assistant|><think>")
    assert not starts_inside(THINK, "<|user|>hi<|assistant|></think>")
    assert not starts_inside(THINK, "<think>old</think><|assistant|>")
    assert not starts_inside(GEMMA, "<|turn>model\n<|channel>thought\n<channel|>")
    assert not starts_inside(None, "<think>")
    # a marker in a message's content (before the last mark) does not open the reply
    text = "user: what is <think>?" + "<|assistant|>"
    assert not starts_inside(THINK, text, [len("user: what is <think>?")])


@pytest.mark.parametrize(
    "module, start, end",
    [
        ("tensorfold_glm.hooks", "<think>", "</think>"),
        ("tensorfold_lfm2_moe.hooks", "<think>", "</think>"),
        ("tensorfold_gemma4.hooks", "<|channel>thought\n", "<channel|>"),
    ],
)
def test_each_family_declares_its_markup(module: str, start: str, end: str) -> None:
    hooks = pytest.importorskip(module).HOOKS
    fmt = hooks.reasoning_format(config={})
    assert (fmt.start, fmt.end) == (start, end)


# -- replies -------------------------------------------------------------------------------------


def _parse(body: str, schemas: Any) -> list[tuple[str, dict[str, Any]]]:
    name, _, args = body.partition(" ")
    if not name.isidentifier():
        raise MalformedToolCall(f"no name in {body!r}")
    return [(name, json.loads(args or "{}"))]


CALLS = ToolCallFormat("test", "<call>", "</call>", _parse)
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TEXTS = TokenTexts(SimpleNamespace(hf=SimpleNamespace(decoder=None)))  # type: ignore[arg-type]


def _parsed(thinking: bool, tools: bool = False, n: int = 1) -> Parsed:
    request = parse_tool_request({"tools": [TOOL]}, "fam", CALLS) if tools else None
    return Parsed(
        "chat",
        [1, 2],
        SamplingParams(max_tokens=64),
        n=n,
        tools=request,
        reasoning=THINK,
        thinking=thinking,
    )


def _events(pieces: list[str], reason: str = "stop") -> list[Any]:
    out: list[Any] = [TokenOut("r", i, i, p, 0.0, []) for i, p in enumerate(pieces)]
    return out + [Finished("r", reason, "", 2, len(pieces), 0, 7)]  # type: ignore[arg-type]


def _whole(parsed: Parsed, events: list[Any]) -> dict[str, Any]:
    reply = Reply(parsed, "demo", 7, TEXTS)
    for event in events:
        reply.add(event)
    body = reply.response()
    ChatCompletion.model_validate(body)
    return body


def _streamed(parsed: Parsed, events: list[Any]) -> list[dict[str, Any]]:
    reply, data = Reply(parsed, "demo", 7, TEXTS), b""
    for event in events:
        reply.add(event)
        if event.text:
            data += reply.sse_chunks(event.text, [], 0)
    data += reply.finish() + sse(b"[DONE]")
    lines = [line.removeprefix(b"data: ") for line in data.split(b"\n\n") if line]
    chunks = [json.loads(line) for line in lines[:-1]]
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    return chunks


def _joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks)


GLM_REPLY = ["Two", " and two", "</th", "ink>", "\n\n", "It is", " 4."]


def test_reasoning_whole_and_streamed_agree_and_its_tokens_are_counted() -> None:
    body = _whole(_parsed(thinking=True), _events(GLM_REPLY))
    message = body["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and two", "It is 4.")
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    chunks = _streamed(_parsed(thinking=True), _events(GLM_REPLY))
    assert _joined(chunks, "reasoning_content") == "Two and two"
    assert _joined(chunks, "content") == "It is 4."
    kinds = [k for c in chunks for k in c["choices"][0]["delta"] if k != "role"]
    last_thought = max(i for i, k in enumerate(kinds) if k == "reasoning_content")
    assert all(k != "reasoning_content" for k in kinds[last_thought + 1 :])
    assert "reasoning_content" not in kinds[kinds.index("content", 1) :]  # content after
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_reply_that_does_not_think_has_no_reasoning_key() -> None:
    body = _whole(_parsed(thinking=False), _events(["It is", " 4."]))
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == "It is 4."
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_a_reply_cut_inside_thinking_has_only_reasoning() -> None:
    events = _events(["<think>", "let me", " see </th"], "length")
    message = _whole(_parsed(thinking=False), events)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("let me see </th", "")
    chunks = _streamed(_parsed(thinking=False), events)
    assert (_joined(chunks, "reasoning_content"), _joined(chunks, "content")) == (
        "let me see </th",
        "",
    )


def test_a_tool_call_after_thinking_parses_and_one_inside_it_does_not() -> None:
    pieces = ["I could <call>get_time</call>.", "</think>", "<call>get_time {}", "</call>"]
    body = _whole(_parsed(thinking=True, tools=True), _events(pieces))
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "I could <call>get_time</call>."
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    chunks = _streamed(_parsed(thinking=True, tools=True), _events(pieces))
    assert _joined(chunks, "reasoning_content") == "I could <call>get_time</call>."
    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert calls_from_deltas(deltas) == [("get_time", {})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_constrained_reply_is_all_content() -> None:
    """A grammar holds the reply from its first token: nothing in it is thinking."""
    parsed = _parsed(thinking=True)
    constraint = SimpleNamespace(start=lambda: None)
    parsed.params = SamplingParams(max_tokens=64, constraint=constraint)
    body = _whole(parsed, _events(['{"a": "', "</think>", '"}']))
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == '{"a": "</think>"}'
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_n_choices_add_their_reasoning_tokens() -> None:
    choices = Choices(_parsed(thinking=True, n=2), "demo", 7, TEXTS, 2)
    for i, pieces in enumerate((GLM_REPLY, ["x", "</think>", "y"])):
        for event in _events(pieces):
            choices[i].add(event)
    usage = choices.response()["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 4 + 2}


# -- reasoning in --------------------------------------------------------------------------------


def test_template_kwargs_effort_and_the_server_default() -> None:
    assert template_kwargs({}, None) is None
    assert template_kwargs({}, True) == {"enable_thinking": True}
    sent = {"chat_template_kwargs": {"enable_thinking": True, "clear_thinking": False}}
    assert template_kwargs(sent, False) == {"enable_thinking": True, "clear_thinking": False}
    assert template_kwargs({"reasoning_effort": "none"}, True) == {
        "reasoning_effort": "none",
        "enable_thinking": False,
    }
    both = {"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}
    assert template_kwargs(both, None) == {"enable_thinking": True, "reasoning_effort": "none"}
    assert template_kwargs({"reasoning_effort": "high"}, None) == {"reasoning_effort": "high"}


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "an object"),
        (
            {"chat_template_kwargs": {"messages": [], "add_generation_prompt": False}},
            "chat_template_kwargs",
            "may not set add_generation_prompt, messages",
        ),
        ({"reasoning_effort": "max"}, "reasoning_effort", "none, minimal, low, medium, high"),
        ({"reasoning_effort": 3}, "reasoning_effort", "must be a string"),
    ],
)
def test_bad_reasoning_fields_are_named(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as caught:
        template_kwargs(body, None)
    assert caught.value.status == 400 and caught.value.param == param
    assert words in caught.value.message


def test_a_prior_turns_reasoning_must_be_text() -> None:
    from tensorfold.server.openai_api import parse_chat

    served = SimpleNamespace(model_name="demo")
    turn = {"role": "assistant", "content": "4", "reasoning_content": {"steps": 2}}
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [turn]}, served)  # type: ignore[arg-type]
    assert caught.value.param == "messages"
    assert "messages[0].reasoning_content must be a string" in caught.value.message


def _tokenizer(template: str) -> Tokenizer:
    """Byte-level BPE over single bytes, with the markers as special tokens."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<think>", "</think>", "<|channel>", "<channel|>", "<eos>"])
    return Tokenizer(hf, eos_token="<eos>", chat_templates={"default": template})


ASK = [{"role": "user", "content": "What is 2+2? <think> is a tag."}]


@pytest.mark.parametrize(
    "name, fmt, enable, tail, inside",
    [
        ("GLM-4.7-Flash.jinja", THINK, None, "<|assistant|><think>", True),
        ("GLM-4.7-Flash.jinja", THINK, True, "<|assistant|><think>", True),
        ("GLM-4.7-Flash.jinja", THINK, False, "<|assistant|></think>", False),
        ("google-gemma-4-31B-it.jinja", GEMMA, None, "model\n<|channel>thought\n<channel|>", False),
        (
            "google-gemma-4-31B-it.jinja",
            GEMMA,
            False,
            "model\n<|channel>thought\n<channel|>",
            False,
        ),
        ("google-gemma-4-31B-it.jinja", GEMMA, True, "<turn|>\n<|turn>model\n", False),
    ],
)
def test_enable_thinking_reaches_the_real_templates(
    name: str, fmt: ReasoningFormat, enable: bool | None, tail: str, inside: bool
) -> None:
    tok = _tokenizer(real_template(name))
    body = {} if enable is None else {"chat_template_kwargs": {"enable_thinking": enable}}
    job = PromptJob(
        4096,
        10**6,
        ASK,
        template_kwargs=template_kwargs(body, None),
        reasoning=fmt,
        protect=tok.special_tokens(),
    )
    prompt = make_prompt(tok, job)
    text = tok.decode(prompt.ids, skip_special_tokens=False)
    assert text.endswith(tail) and prompt.thinking is inside
    if enable:  # Gemma 4 says so in its system turn
        assert "<|think|>" in text or name.startswith("GLM")


def test_reasoning_effort_none_and_the_server_default_turn_glm_thinking_off() -> None:
    tok = _tokenizer(real_template("GLM-4.7-Flash.jinja"))
    for body, default in (({"reasoning_effort": "none"}, None), ({}, False)):
        job = PromptJob(4096, 10**6, ASK, template_kwargs=template_kwargs(body, default))
        text = tok.decode(make_prompt(tok, job).ids, skip_special_tokens=False)
        assert text.endswith("<|assistant|></think>")


@pytest.mark.parametrize("name", ["GLM-4.7-Flash.jinja", "google-gemma-4-31B-it.jinja"])
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_prior_turns_reasoning_reaches_the_template(name: str, field: str) -> None:
    """Each template keeps the last assistant turn's thinking after the last user message (GLM
    always; Gemma 4 with tool calls) and drops it from older turns."""
    tok = _tokenizer(real_template(name))
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    chat = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", field: "THOUGHT-1", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "10:42"},
    ]
    job = PromptJob(4096, 10**6, chat, tools=[TOOL])
    text = tok.decode(make_prompt(tok, job).ids, skip_special_tokens=False)
    assert "THOUGHT-1" in text
    later = [*chat, {"role": "assistant", "content": "10:42."}, {"role": "user", "content": "?"}]
    text = tok.decode(make_prompt(tok, PromptJob(4096, 10**6, later)).ids, False)
    assert "THOUGHT-1" not in text


# -- the flag and the setting --------------------------------------------------------------------


def test_the_reasoning_flag_and_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().reasoning == "auto"
    monkeypatch.setenv("TF_REASONING", "off")
    assert Settings().reasoning == "off"
    args = parse_args(["serve", "--reasoning", "on"])
    assert settings_from_args(args).reasoning == "on"
    monkeypatch.setenv("TF_REASONING", "maybe")
    with pytest.raises(SettingsError, match="TF_REASONING=maybe.*auto, on, off"):
        Settings()
