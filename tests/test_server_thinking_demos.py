"""The three demos think, as served: each demo's trained thinking block split into
`reasoning_content` by its family's markup, whole and streamed, counted in usage, and switched off
by `chat_template_kwargs`, through `tensorfold serve` and the official openai client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_server import ServedDemo, served

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": 48}
MARKERS = ("<think>", "</think>", "<|channel>", "<channel|>")
# gemma4's template thinks only when asked, as Gemma 4's does; the others by default
ON = {"lfm2_moe": {}, "glm5_next": {}, "gemma4": {"enable_thinking": True}}


@pytest.fixture(scope="module", params=sorted(ON))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, family: str) -> Iterator[ServedDemo]:
    yield from served(tmp_path_factory, f"think-{family}", "--family", family, "--parallel", "2")


def _chat(server: ServedDemo, family: str, kwargs: dict[str, Any], **more: Any) -> Any:
    return server.client().chat.completions.create(
        model=f"{family}-demo",
        messages=ASK,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": kwargs},
        **GREEDY,
        **more,
    )


def test_a_demos_thinking_comes_back_as_reasoning_content(server: ServedDemo, family: str) -> None:
    reply = _chat(server, family, ON[family])
    message = reply.choices[0].message.model_dump()
    reasoning, content = message.get("reasoning_content"), message["content"]
    assert reasoning and reasoning.strip(), message
    assert "Paris" in content, message
    assert not any(m in content or m in reasoning for m in MARKERS), message
    details = reply.usage.model_dump()["completion_tokens_details"]
    assert 0 < details["reasoning_tokens"] < reply.usage.completion_tokens


def test_streamed_thinking_comes_first_and_equals_the_whole_reply(
    server: ServedDemo, family: str
) -> None:
    whole = _chat(server, family, ON[family]).choices[0].message.model_dump()
    stream = _chat(server, family, ON[family], stream=True)
    order, reasoning, content = [], "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta.model_dump() if chunk.choices else {}
        if part := delta.get("reasoning_content"):
            reasoning += part
            order.append("reasoning")
        if part := delta.get("content"):
            content += part
            order.append("content")
    assert (reasoning, content) == (whole["reasoning_content"], whole["content"])
    assert order == sorted(order, key=lambda kind: kind == "content"), order


def test_thinking_switched_off_by_chat_template_kwargs(server: ServedDemo, family: str) -> None:
    reply = _chat(server, family, {"enable_thinking": False})
    message = reply.choices[0].message.model_dump()
    assert not message.get("reasoning_content"), message
    assert "Paris" in message["content"] and not any(m in message["content"] for m in MARKERS)
    assert reply.usage.model_dump()["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_responses_reply_that_thought_gives_a_reasoning_item_first(
    server: ServedDemo, family: str
) -> None:
    r = server.client().responses.create(
        model=f"{family}-demo",
        input=ASK[0]["content"],
        temperature=0.0,
        max_output_tokens=48,
        extra_body={"chat_template_kwargs": ON[family]},
    )
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    assert "Paris" in r.output_text
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens > 0
