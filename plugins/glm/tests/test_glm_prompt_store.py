"""The prompt store on the demo checkpoint (fp32): resumed == fresh over multi-turn chats and at
marks on and off the grid of usable marks (index_kpool = 16 rows; 64 is the KDA chunk grid a
chunked kernel would add), keeps tapped inside a pass with no extra pass, poisoned pages and
evictions; the census even after each."""

from __future__ import annotations

import random
from typing import Sequence

import pytest

from tensorfold import conformance, testing
from tensorfold.llm import LLM
from tensorfold.testing import close_even
from tensorfold_glm.demo import build_demo


class TestPromptStore(conformance.PromptStoreGates):
    family, build_demo = "glm5_next", build_demo
    words = (
        "lake winter village fire storm market apples bread cheese music lighthouse captain "
        "river mountain spider planet letter story garden morning"
    ).split()
    max_tokens, chats, turns, parallel = 8, 5, 3, 3
    first_turn, first_turns, later_turn = 1300, 20, 15  # chat 0's first turn passes 2048 rows
    fresh_sampling, host_kept = ("sampled",), 2

    def check_resumed(self, cached: list[list[int]]) -> None:
        assert all(n % 64 == 0 for turn in cached for n in turn)  # the KDA chunk grid

    @pytest.mark.parametrize(
        "flags", [{"kv_share": 32}, {"kv_share": 32, "kv_poison": True}, {"kv_share": 2}]
    )
    def test_resumed_equals_fresh_over_chats(self, demo, fresh, flags):
        llm = self.open_llm(demo, parallel=3, **flags)
        try:
            replies, cached = self.run_chats(llm, self.sampling("sampled"))
            assert replies == fresh["sampled"]
            assert all(n == 0 for n in cached[0])
            if flags["kv_share"] > 2:  # room for every state: chat 0 resumed past the grid mark
                assert all(n >= 2048 for n in (cached[1][0], cached[2][0])), cached
            self.check_resumed(cached)
            if flags["kv_share"] == 2:  # fewer states than the chats keep: some were evicted
                assert llm.served.engine.lanes.sharing.evictions > 0
        finally:
            close_even(llm)

    def submit(self, llm: LLM, ids: Sequence[int], marks: Sequence[int]) -> tuple[list[int], int]:
        return testing.submit_with_marks(llm, ids, marks, self.sampling("greedy"))

    def test_marks_on_and_off_the_grid_resume_exactly(self, demo):
        rng = random.Random(5)
        first = [rng.randrange(20, 800) for _ in range(300)]
        # usable marks are KDA chunk boundaries (multiples of 64): 64, 192 (from 200), 256 (from
        # 260)
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
            llm = self.open_llm(demo, parallel=1, kv_share=share)
            try:
                results[share] = {"first": self.submit(llm, first, marks)}
                passes[share] = llm.served.engine.lanes.passes
                for name, (ids, _) in follow.items():
                    results[share][name] = self.submit(llm, ids, [])
            finally:
                close_even(llm)
        assert passes[16] == passes[0]  # the keeps were tapped inside the prompt's one pass
        for name, (_, resumed_at) in follow.items():
            tokens, cached = results[16][name]
            assert cached == resumed_at, name
            assert tokens == results[0][name][0], name
