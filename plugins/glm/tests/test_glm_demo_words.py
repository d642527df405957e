"""The glm5_next demo checkpoint writes words: its greedy replies to fixed prompts, through the
family's own loader and the lanes, are readable text made of the words it was trained on
(tensorfold.testing.assert_demo_writes_words); and it thinks as its template asks, with
thinking on by default, like GLM's (tensorfold.testing.assert_demo_thinks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tensorfold
from tensorfold import testing


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tensorfold.LLM]:
    cache = tmp_path_factory.mktemp("demo")
    with tensorfold.LLM(family="glm5_next", demo_cache=cache, context=1024, parallel=2) as llm:
        yield llm


def test_greedy_replies_are_words(llm: tensorfold.LLM) -> None:
    testing.assert_demo_writes_words(llm)


def test_greedy_replies_think_when_asked(llm: tensorfold.LLM) -> None:
    testing.assert_demo_thinks(llm, "<think>", "</think>", on_by_default=True)
