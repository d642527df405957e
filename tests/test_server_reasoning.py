"""Reasoning fields against a real `tensorfold serve --reasoning off` of the demo (lfm2_moe), with
the official openai client: chat_template_kwargs, reasoning_effort and a prior turn's
reasoning_content accepted, named 400s for bad ones, usage's reasoning_tokens, and the streamed
reply's reasoning and content equal to the whole one's. Whether the demo thinks is not asserted
here: the split itself is tested on engine events (tests/test_reasoning.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from test_server import ServedDemo, served

MODEL = "lfm2_moe-demo"
ASK = [{"role": "user", "content": "The little cat"}]
FIXED = {"temperature": 0.0, "seed": 3, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(tmp_path_factory, "reasoning", "--parallel", "2", "--reasoning", "off")


@pytest.fixture(scope="module")
def client(server: ServedDemo) -> openai.OpenAI:
    return server.client()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"chat_template_kwargs": "on"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"reasoning_effort": "maximal"}, "reasoning_effort"),
    ],
)
def test_bad_reasoning_fields_get_a_named_400(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=extra)
    body: Any = caught.value.body
    assert body["param"] == param and param in body["message"]


def test_reasoning_fields_are_served_and_stream_matches_whole(client: openai.OpenAI) -> None:
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": "sat.", "reasoning_content": "cats sit"},
        {"role": "user", "content": "And then?"},
    ]
    extra = {"chat_template_kwargs": {"enable_thinking": True, "custom_flag": 1}}
    whole = client.chat.completions.create(
        model=MODEL, messages=history, reasoning_effort="low", extra_body=extra, **FIXED
    )
    usage = whole.model_dump()["usage"]
    thought = usage["completion_tokens_details"]["reasoning_tokens"]
    assert 0 <= thought <= usage["completion_tokens"]
    message = whole.choices[0].message.model_dump()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=history,
        reasoning_effort="low",
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
        **FIXED,
    )
    reasoning = content = ""
    last: Any = None
    for chunk in stream:
        last = chunk
        if chunk.choices:
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (message.get("reasoning_content") or "", message["content"])
    assert last.usage.model_dump()["completion_tokens_details"]["reasoning_tokens"] == thought


def test_reasoning_effort_none_is_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, reasoning_effort="none", max_tokens=2
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
