"""The prompt store on the demo checkpoint (fp32): resumed == fresh over multi-turn chats,
marks inside a pass, pressure and eviction, poisoned pages; the census even after each."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.memory.kv_plan import GiB, KiB
from tensorfold.testing import close_even
from tensorfold_lfm2_moe.demo import build_demo

WORDS = (
    "river stone light garden window paper cloud music winter morning bread silver road "
    "forest candle harbor letter mountain voice summer lantern orchard meadow thunder"
).split()
GREEDY = SamplingParams(temperature=0, max_tokens=12)
SAMPLED = SamplingParams(temperature=0.8, seed=99, max_tokens=12)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def open_llm(demo: Path, **flags) -> LLM:
    flags = {"context": 8192, "prompt_cache_gib": 0.05, **flags}
    return testing.open_llm("lfm2_moe", demo, **flags)


def user_turns(chat: int, turns: int = 4) -> list[str]:
    # chat 0's first turn passes the 2048-row grid
    return testing.chat_turns(chat, turns, 900 if chat == 0 else 30, 25, WORDS)


def run_chats(llm: LLM, params: SamplingParams, chats: int = 8, turns: int = 4):
    """Turn by turn, all chats at once; returns each turn's replies and cached token counts."""
    return testing.run_chats(llm, [user_turns(c, turns) for c in range(chats)], params)


@pytest.fixture(scope="module")
def fresh(demo):
    llm = open_llm(demo, parallel=4)
    try:
        return {
            name: run_chats(llm, p)[0] for name, p in (("greedy", GREEDY), ("sampled", SAMPLED))
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
        assert llm.served.engine.lanes.rows_cached > 0
    finally:
        close_even(llm)


def test_poisoned_pages_with_the_store_on_give_the_same_replies(demo, fresh):
    llm = open_llm(demo, parallel=4, kv_share=64, kv_poison=True)
    try:
        assert run_chats(llm, SAMPLED)[0] == fresh["sampled"]
    finally:
        close_even(llm)


def test_pressure_and_eviction_keep_every_reply(demo, fresh):
    # An 8192-token window is 16 pages; four lanes plan 16 + 3 pages, and a cache of 8 pages
    # (4 MiB) for the store: streams short of pages evict kept prompts before they wait.
    room = 19 * 512 * KiB + 4 * 4 * KiB + 8 * 512 * KiB + 16 * 4 * KiB
    llm = open_llm(demo, parallel=4, kv_share=16, memory_limit_gib=room / GiB, prompt_cache_gib=1)
    try:
        assert run_chats(llm, SAMPLED)[0] == fresh["sampled"]
        assert llm.served.engine.lanes.sharing.evictions > 0
    finally:
        close_even(llm)


def test_a_mark_inside_a_pass_resumes_there_with_no_extra_pass(demo):
    testing.assert_a_mark_inside_a_pass_resumes_there(
        lambda **flags: open_llm(demo, **flags),
        " ".join(WORDS * 2),
        " ".join(reversed(WORDS)),
        GREEDY,
    )


def test_states_resumed_from_the_host_tier_give_the_same_replies(demo, fresh):
    # Four kept states on the device for 8 chats: the store evicts to the host tier all along,
    # and later turns copy their states back from it (poisoned pages and host pages: a stale
    # row changes tokens). The census counts the host pages too.
    llm = open_llm(demo, parallel=4, kv_share=4, kv_host_gib=0.1, kv_poison=True)
    try:
        replies, cached = run_chats(llm, SAMPLED)
        assert replies == fresh["sampled"]
        testing.assert_host_tier_served(llm, cached)
        assert all(n > 0 for turn in cached[1:] for n in turn), cached
    finally:
        close_even(llm)
