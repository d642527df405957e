"""The prompt store on the demo checkpoint (fp32): resumed == fresh over multi-turn chats and at
marks on and off the grid of usable marks (index_kpool = 16 rows; 64 is the KDA chunk grid a
chunked kernel would add), keeps tapped inside a pass with no extra pass, poisoned pages and
evictions; the census even after each."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence

import pytest

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.testing import close_even
from tensorfold_glm.demo import build_demo

WORDS = (
    "lake winter village fire storm market apples bread cheese music lighthouse captain "
    "river mountain spider planet letter story garden morning"
).split()
GREEDY = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.8, seed=99, max_tokens=8)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def open_llm(demo: Path, **flags) -> LLM:
    flags = {"context": 4096, "prompt_cache_gib": 0.05, **flags}
    return testing.open_llm("glm5_next", demo, **flags)


def user_turns(chat: int, turns: int) -> list[str]:
    # chat 0's first turn passes the 2048-row grid
    return testing.chat_turns(chat, turns, 1300 if chat == 0 else 20, 15, WORDS)


def run_chats(llm: LLM, params: SamplingParams, chats: int = 5, turns: int = 3):
    """Turn by turn, all chats at once; returns each turn's replies and cached token counts."""
    return testing.run_chats(llm, [user_turns(c, turns) for c in range(chats)], params)


@pytest.fixture(scope="module")
def fresh(demo):
    llm = open_llm(demo, parallel=3)
    try:
        return run_chats(llm, SAMPLED)[0]
    finally:
        close_even(llm)


@pytest.mark.parametrize(
    "flags", [{"kv_share": 32}, {"kv_share": 32, "kv_poison": True}, {"kv_share": 2}]
)
def test_resumed_equals_fresh_over_chats(demo, fresh, flags):
    llm = open_llm(demo, parallel=3, **flags)
    try:
        replies, cached = run_chats(llm, SAMPLED)
        assert replies == fresh
        assert all(n == 0 for n in cached[0])
        if flags["kv_share"] > 2:  # room for every state: chat 0 resumed past the grid mark
            assert all(n >= 2048 for n in (cached[1][0], cached[2][0])), cached
        assert all(n % 64 == 0 for turn in cached for n in turn)  # the KDA chunk grid
        if flags["kv_share"] == 2:  # fewer states than the chats keep: some were evicted
            assert llm.served.engine.lanes.sharing.evictions > 0
    finally:
        close_even(llm)


def test_states_resumed_from_the_host_tier_give_the_same_replies(demo, fresh):
    # Two kept states on the device: the store evicts to the host tier, and later turns copy
    # their latent, indexer and KDA states back from it (poisoned pages: a stale row shows).
    llm = open_llm(demo, parallel=3, kv_share=2, kv_host_gib=0.1, kv_poison=True)
    try:
        replies, cached = run_chats(llm, SAMPLED)
        assert replies == fresh
        testing.assert_host_tier_served(llm, cached)
        assert all(n % 64 == 0 for turn in cached for n in turn)
    finally:
        close_even(llm)


def submit(llm: LLM, ids: Sequence[int], marks: Sequence[int]) -> tuple[list[int], int]:
    return testing.submit_with_marks(llm, ids, marks, GREEDY)


def test_marks_on_and_off_the_grid_resume_exactly(demo):
    rng = random.Random(5)
    first = [rng.randrange(20, 800) for _ in range(300)]
    # usable marks are KDA chunk boundaries (multiples of 64): 64, 192 (from 200), 256 (from 260)
    marks = [48, 50, 64, 200, 260]
    follow = {  # prompt -> where a resume must start
        "past 260": (first[:280] + [21, 22, 23], 256),
        "past 200": (first[:230] + [24, 25], 192),
        "past 64": (first[:70] + [31, 32], 64),
        "at 65": (first[:65] + [41, 42, 43], 64),
        "before 64": (first[:60] + [51, 52], 0),
    }
    results, passes = {}, {}
    for share in (0, 16):
        llm = open_llm(demo, parallel=1, kv_share=share)
        try:
            results[share] = {"first": submit(llm, first, marks)}
            passes[share] = llm.served.engine.lanes.passes
            for name, (ids, _) in follow.items():
                results[share][name] = submit(llm, ids, [])
        finally:
            close_even(llm)
    assert passes[16] == passes[0]  # the keeps were tapped inside the prompt's one pass
    for name, (_, resumed_at) in follow.items():
        tokens, cached = results[16][name]
        assert cached == resumed_at, name
        assert tokens == results[0][name][0], name
