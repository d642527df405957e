"""The prompt store on the gemma4 demo checkpoint (fp32): resumed == fresh over multi-turn chats
whose history outgrows the 128-row sliding window, a mark inside a pass, poisoned pages; the
census even after each."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tensorfold.llm import LLM
from tensorfold.sampling import SamplingParams
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
    flags = {"context": 4096, "memory_limit_gib": 0.25, "prompt_cache_gib": 0.05, **flags}
    return LLM(family="gemma4", model=demo, device="cpu", dtype="float32", **flags)


def close_even(llm: LLM) -> None:
    lanes = llm.served.engine.lanes
    llm.close()
    census = lanes.pool.census()
    assert lanes.uneven == 0 and census.idle_even, census.line()


def user_turns(chat: int) -> list[str]:
    rng = random.Random(chat)
    length = 220 if chat == 0 else 30  # chat 0's first turn passes a 512-row page
    return [" ".join(rng.choice(WORDS) for _ in range(length if t == 0 else 25))
            for t in range(TURNS)]


def run_chats(llm: LLM, params: SamplingParams):
    """Turn by turn, all chats at once; returns each turn's replies and cached token counts."""
    histories: list[list[dict]] = [[] for _ in range(CHATS)]
    users = [user_turns(c) for c in range(CHATS)]
    replies, cached, prompt_lens = [], [], []
    for t in range(TURNS):
        for c in range(CHATS):
            histories[c].append({"role": "user", "content": users[c][t]})
        done = llm.chat(histories, params)
        replies.append([d.token_ids for d in done])
        cached.append([d.cached_tokens for d in done])
        prompt_lens.append([len(d.prompt_token_ids) for d in done])
        for c, d in enumerate(done):
            histories[c].append({"role": "assistant", "content": d.text})
    return replies, cached, prompt_lens


@pytest.fixture(scope="module")
def fresh(demo):
    llm = open_llm(demo, parallel=4)
    try:
        return {name: run_chats(llm, params)[0]
                for name, params in (("greedy", GREEDY), ("sampled", SAMPLED))}
    finally:
        close_even(llm)


@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_resumed_equals_fresh_over_chats(demo, fresh, name):
    llm = open_llm(demo, parallel=4, kv_share=64)
    try:
        replies, cached, lens = run_chats(llm, {"greedy": GREEDY, "sampled": SAMPLED}[name])
        assert replies == fresh[name]
        assert all(n == 0 for n in cached[0])
        for turn in cached[1:]:
            assert all(n > 0 for n in turn), cached
        assert max(lens[-1]) > 512 and min(cached[-1]) > 128  # resumed past the window
        assert llm.served.engine.lanes.rows_cached > 0
    finally:
        close_even(llm)


def test_poisoned_pages_with_the_store_on_give_the_same_replies(demo, fresh):
    llm = open_llm(demo, parallel=4, kv_share=64, kv_poison=True)
    try:
        assert run_chats(llm, SAMPLED)[0] == fresh["sampled"]
    finally:
        close_even(llm)


def test_a_mark_inside_a_pass_resumes_there_with_no_extra_pass(demo):
    from tensorfold.chat_template import marks_to_token_positions, render_chat

    a, b = " ".join(WORDS * 3), " ".join(reversed(WORDS))
    first = [{"role": "user", "content": a}, {"role": "assistant", "content": b},
             {"role": "user", "content": "river stone"}]
    second = first[:2] + [{"role": "user", "content": "winter morning light"}]
    passes, replies = {}, {}
    for share in (0, 16):
        llm = open_llm(demo, parallel=1, kv_share=share)
        try:
            tok = llm.tokenizer
            chat = render_chat(tok.chat_template, second, bos_token=tok.bos_token,
                               eos_token=tok.eos_token)
            turn_ends = marks_to_token_positions(tok, chat.text, chat.marks)
            done = [llm.chat([first], GREEDY)[0], llm.chat([second], GREEDY)[0]]
            replies[share] = [c.token_ids for c in done]
            passes[share] = llm.served.engine.lanes.passes
            if share:
                # the model turn ended inside the first request's only prompt pass: the second
                # resumes exactly at that mark, past the sliding window
                assert 128 < turn_ends[1] < len(done[0].prompt_token_ids) <= 2048
                assert done[1].cached_tokens == turn_ends[1]
        finally:
            close_even(llm)
    assert replies[16] == replies[0]
    assert passes[16] == passes[0]
