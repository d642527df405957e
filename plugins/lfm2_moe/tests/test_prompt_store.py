"""The prompt store on the demo checkpoint (fp32): resumed == fresh over multi-turn chats,
marks inside a pass, poisoned pages, the host tier (tensorfold.conformance), and pressure and
eviction; the census even after each."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold.memory.kv_plan import GiB, KiB
from tensorfold.testing import close_even
from tensorfold_lfm2_moe.demo import build_demo


class TestPromptStore(conformance.PromptStoreResumes):
    family, build_demo = "lfm2_moe", build_demo
    words = (
        "river stone light garden window paper cloud music winter morning bread silver road "
        "forest candle harbor letter mountain voice summer lantern orchard meadow thunder"
    ).split()
    context, max_tokens, chats, turns = 8192, 12, 8, 4
    first_turn, first_turns, later_turn = 900, 30, 25  # chat 0's first turn passes 2048 rows

    def test_pressure_and_eviction_keep_every_reply(self, demo, fresh):
        # An 8192-token window is 16 pages; four lanes plan 16 + 3 pages, and a cache of 8 pages
        # (4 MiB) for the store: streams short of pages evict kept prompts before they wait.
        room = 19 * 512 * KiB + 4 * 4 * KiB + 8 * 512 * KiB + 16 * 4 * KiB
        flags = dict(kv_share=16, memory_limit_gib=room / GiB, prompt_cache_gib=1)
        llm = self.open_llm(demo, parallel=4, **flags)
        try:
            assert self.run_chats(llm, self.sampling("sampled"))[0] == fresh["sampled"]
            assert llm.served.engine.lanes.sharing.evictions > 0
        finally:
            close_even(llm)
