"""The demo checkpoint writes words: its greedy replies to fixed prompts, through the family's
own loader and the lanes, are readable text made of the words it was trained on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tensorfold
from tensorfold import SamplingParams
from tensorfold.demo_text import known_share

CHATS = ["What is the capital of France?", "Tell me a story.", "Hello!", "Who are you?"]
COMPLETIONS = ["Once upon a time", "The little engine"]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("demo")
    with tensorfold.LLM(family="lfm2_moe", demo_cache=Path(cache), context=1024,
                        parallel=2) as llm:
        yield llm


def test_greedy_chat_replies_are_words(llm) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    replies = llm.chat([[{"role": "user", "content": p}] for p in CHATS], greedy)
    for prompt, reply in zip(CHATS, replies):
        text = reply.text
        assert reply.finish_reason == "stop", (prompt, text)  # it ends its turn
        assert len(re.findall(r"[A-Za-z]+", text)) >= 3, (prompt, text)
        assert known_share(text) >= 0.8, (prompt, text)
        assert not re.search(r"[\ufffd\x00-\x08\x0b-\x1f]", text), (prompt, text)
    assert "Paris" in replies[0].text, replies[0].text


def test_greedy_completions_are_words(llm) -> None:
    replies = llm.generate(COMPLETIONS, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, reply in zip(COMPLETIONS, replies):
        assert len(re.findall(r"[A-Za-z]+", reply.text)) >= 8, (prompt, reply.text)
        assert known_share(reply.text) >= 0.8, (prompt, reply.text)
