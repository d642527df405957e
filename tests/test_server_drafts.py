"""Drafts as served (`tensorfold serve --draft ngram`; `--draft mtp` on the GLM demo): OpenAI's
Predicted Outputs on chat and completions, whole and streamed, through the official openai
client; usage counts the prediction's accepted and rejected tokens, /metrics the drafts. The
tokens themselves are the engine's concern: conformance.DraftGates proves drafted == plain for
every family."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_server import ServedDemo, served

MODEL = "lfm2_moe-demo"
ASK = [{"role": "user", "content": "Tell me a story about a cat."}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 40, "logprobs": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(tmp_path_factory, "drafts", "--parallel", "3", "--draft", "ngram")


def _chat(server: ServedDemo, **more: Any) -> Any:
    return server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **GREEDY,
        **more,
    )


def _tokens(reply: Any) -> list[tuple[str, float]]:
    return [(t.token, t.logprob) for t in reply.choices[0].logprobs.content]


def test_a_chat_with_its_own_answer_as_prediction_gives_that_answer(server: ServedDemo) -> None:
    plain = _chat(server)
    answer = plain.choices[0].message.content
    assert answer
    predicted = _chat(server, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    assert _tokens(predicted) == _tokens(plain)
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0
    assert details.rejected_prediction_tokens == 0
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens is None


def test_a_wrong_prediction_changes_nothing_but_the_counts(server: ServedDemo) -> None:
    plain = _chat(server)
    wrong = "The weather on Mars is cold and dusty, with storms that last for months."
    predicted = _chat(
        server, prediction={"type": "content", "content": [{"type": "text", "text": wrong}]}
    )
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    assert _tokens(predicted) == _tokens(plain)
    details = predicted.usage.completion_tokens_details
    assert details.rejected_prediction_tokens > 0


def test_streamed_with_a_prediction_equals_whole(server: ServedDemo) -> None:
    whole = _chat(server)
    answer = whole.choices[0].message.content
    stream = _chat(
        server,
        prediction={"type": "content", "content": answer},
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    assert text == answer
    assert usage is not None and usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize("prompt", ["Once upon a time there was a", [5, 6, 7, 8, 9]])
def test_completions_take_a_prediction(server: ServedDemo, prompt: Any) -> None:
    c = server.client()
    plain = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    text = plain.choices[0].text
    predicted = c.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        extra_body={"prediction": {"type": "content", "content": text}},
    )
    assert predicted.choices[0].text == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0


def test_metrics_count_the_drafts(server: ServedDemo) -> None:
    _chat(server, prediction={"type": "content", "content": "Once upon a time"})
    metrics = server.wait_even()
    assert metrics["tensorfold_draft_tokens_total"] > 0
    assert 0 < metrics["tensorfold_draft_tokens_accepted_total"]
    assert (
        metrics["tensorfold_draft_tokens_accepted_total"]
        <= metrics["tensorfold_draft_tokens_total"]
    )


@pytest.fixture(scope="module")
def mtp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(
        tmp_path_factory, "drafts-mtp", "--family", "glm5_next", "--parallel", "2", "--draft", "mtp"
    )


def test_glm_demo_served_with_its_mtp_layer(mtp_server: ServedDemo) -> None:
    """`--draft mtp` end to end on the GLM demo: the replies (whole and streamed) are plain
    decoding's, token and logprob for token and logprob, and /metrics counts the MTP's drafts
    and the ones kept."""
    from tensorfold import testing
    from tensorfold.engine.sampling import SamplingParams

    ask = [{"role": "user", "content": "What is the capital of Japan?"}]
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = mtp_server.client().chat.completions.create(
        model="glm5_next-demo",
        messages=ask,
        extra_body=off,
        **GREEDY,  # type: ignore[arg-type]
    )
    stream = mtp_server.client().chat.completions.create(
        model="glm5_next-demo",
        messages=ask,  # type: ignore[arg-type]
        extra_body=off,
        stream=True,
        **GREEDY,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    llm = testing.open_llm("glm5_next", None)  # plain, in this process
    try:
        params = SamplingParams(temperature=0, max_tokens=GREEDY["max_tokens"], logprobs=True)
        plain = llm.chat([ask], params, chat_template_kwargs=off["chat_template_kwargs"])[0]
    finally:
        testing.close_even(llm)
    assert plain.text and reply.choices[0].message.content == streamed == plain.text
    assert [t.logprob for t in reply.choices[0].logprobs.content] == plain.logprobs
    metrics = mtp_server.wait_even()
    assert metrics["tensorfold_draft_tokens_total"] > 0
    kept = metrics["tensorfold_draft_tokens_accepted_total"]
    assert 0 < kept <= metrics["tensorfold_draft_tokens_total"]
