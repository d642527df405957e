"""The lfm2_moe demo checkpoint writes words: its greedy replies to fixed prompts, through the
family's own loader and the lanes, are readable text made of the words it was trained on
(tensorfold.testing.assert_demo_writes_words)."""

from __future__ import annotations

from pathlib import Path

import tensorfold
from tensorfold import testing


def test_greedy_replies_are_words(tmp_path: Path) -> None:
    with tensorfold.LLM(family="lfm2_moe", demo_cache=tmp_path, context=1024, parallel=2) as llm:
        testing.assert_demo_writes_words(llm)
