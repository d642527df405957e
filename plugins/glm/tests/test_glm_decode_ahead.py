"""glm5_next with decode rounds sent ahead (the next round fed on the device by this round's
draws): the gates hold and give the tokens they give without it, its fixed state kept as fed
when a stream ends with a round in flight (resumed == fresh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.sampling import SamplingParams
from tensorfold_glm.demo import build_demo

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def test_gates_hold_with_rounds_sent_ahead_and_equal_them_without(demo: Path) -> None:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(20, 800, (n,), generator=g).tolist() for n in (9, 130, 300)]
    chats = [testing.chat_turns(c, turns=2, first=150, later=20) for c in range(3)]
    testing.assert_gates_sent_ahead_equal_plain("glm5_next", demo, prompts, chats, GREEDY, SAMPLED,
                                                min_cached=100, context=4096, parallel=4)
