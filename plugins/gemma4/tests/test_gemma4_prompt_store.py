"""The prompt store on the gemma4 demo checkpoint (fp32): resumed == fresh over multi-turn chats
whose history outgrows the 128-row sliding window, a mark inside a pass, poisoned pages; the
census even after each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.testing import close_even
from tensorfold_gemma4.demo import build_demo

WORDS = (
    "lighthouse keeper orchard apples river lantern harbor winter morning garden stone window "
    "letter candle meadow thunder fox grapes crow honey summer road forest music"
).split()
GREEDY = SamplingParams(temperature=0, max_tokens=10)
SAMPLED = SamplingParams(temperature=0.8, seed=99, max_tokens=10)
CHATS, TURNS = 4, 3


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def open_llm(demo: Path, **flags) -> LLM:
    return testing.open_llm("gemma4", demo, **{"context": 4096, "prompt_cache_gib": 0.05, **flags})


def user_turns(chat: int) -> list[str]:
    # chat 0's first turn passes a 512-row page
    return testing.chat_turns(chat, TURNS, 220 if chat == 0 else 30, 25, WORDS)


def run_chats(llm: LLM, params: SamplingParams):
    """Turn by turn, all chats at once; returns each turn's replies and cached token counts."""
    return testing.run_chats(llm, [user_turns(c) for c in range(CHATS)], params)


@pytest.fixture(scope="module")
def fresh(demo):
    llm = open_llm(demo, parallel=4)
    try:
        return {
            name: run_chats(llm, params)[0]
            for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))
        }
    finally:
        close_even(llm)


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_resumed_equals_fresh_over_chats(demo, fresh, name):
    llm = open_llm(demo, parallel=4, kv_share=64)
    try:
        replies, cached = run_chats(llm, {"greedy": GREEDY, "sampled": SAMPLED}[name])
        assert replies == fresh[name]
        assert all(n == 0 for n in cached[0])
        for turn in cached[1:]:
            assert all(n > 0 for n in turn), cached
        assert max(cached[-1]) > 512 and min(cached[-1]) > 128  # past a page and the window
        assert llm.served.engine.lanes.rows_cached > 0
    finally:
        close_even(llm)


def test_poisoned_pages_with_the_store_on_give_the_same_replies(demo, fresh):
    llm = open_llm(demo, parallel=4, kv_share=64, kv_poison=True)
    try:
        assert run_chats(llm, SAMPLED)[0] == fresh["sampled"]
    finally:
        close_even(llm)


def test_states_resumed_from_the_host_tier_give_the_same_replies(demo, fresh):
    # Four kept states on the device: the store evicts to the host tier, and later turns copy
    # their pages and sliding rings back from it (poisoned pages: a stale row shows).
    llm = open_llm(demo, parallel=4, kv_share=4, kv_host_gib=0.1, kv_poison=True)
    try:
        replies, cached = run_chats(llm, SAMPLED)
        assert replies == fresh["sampled"]
        testing.assert_host_tier_served(llm, cached)
        assert all(n > 0 for turn in cached[1:] for n in turn), cached
    finally:
        close_even(llm)


def test_a_mark_inside_a_pass_resumes_there_with_no_extra_pass(demo):
    # the mark lies past the demo's 128-row sliding window: the kept rings carry the resume
    testing.assert_a_mark_inside_a_pass_resumes_there(
        lambda **flags: open_llm(demo, **flags),
        " ".join(WORDS * 3),
        " ".join(reversed(WORDS)),
        GREEDY,
        past=128,
    )
