"""The prompt store on the gemma4 demo checkpoint (fp32), tensorfold.conformance's gates:
resumed == fresh over multi-turn chats whose history outgrows the 128-row sliding window (the
kept rings carry the resume), a mark inside a pass past the window, poisoned pages, the host
tier; the census even after each."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_gemma4.demo import build_demo


class TestPromptStore(conformance.PromptStoreResumes):
    family, build_demo = "gemma4", build_demo
    words = (
        "lighthouse keeper orchard apples river lantern harbor winter morning garden stone window "
        "letter candle meadow thunder fox grapes crow honey summer road forest music"
    ).split()
    max_tokens, chats, turns = 10, 4, 3
    first_turn, first_turns, later_turn = 220, 30, 25  # chat 0's first turn passes a page
    mark_past, mark_repeats = 128, 3  # the mark lies past the sliding window

    def check_resumed_chats(self, cached: list[list[int]]) -> None:
        assert max(cached[-1]) > 512 and min(cached[-1]) > 128  # past a page and the window
