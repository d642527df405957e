"""The exactness gates through the lanes and the engine thread, on the demo checkpoint (fp32):
concurrent == solo, n choices, pages == windows, poisoned == clean (tensorfold.conformance), and
pool pressure. Every engine's census must be even when it goes idle."""

from __future__ import annotations

import json

from tensorfold import conformance
from tensorfold.memory.kv_plan import GiB
from tensorfold.testing import close_even, tokens
from tensorfold_glm.demo import build_demo
from tensorfold_glm.layout import shape


class TestEngineGates(conformance.ChoicesGate):
    family, build_demo = "glm5_next", build_demo
    lengths = [5, 17, 90, 700, 2100]  # past the sparse-selection point; one longer than a pass
    ids = (20, 800)

    def test_pool_pressure_makes_streams_wait_with_the_same_outputs(self, demo, prompts, alone):
        layout = shape(json.loads((demo / "config.json").read_text()), "float32").layout
        page = 512 * layout.row_bytes
        # A 4096-token window is 8 pages; three lanes plan 8 + 2 pages (a window and a page for
        # each other lane): 5120 rows for five prompts of up to 2100 + 8 rows, so streams wait.
        room = 10 * page + 3 * layout.fixed_bytes
        llm = self.open_llm(demo, parallel=3, memory_limit_gib=room / GiB)
        try:
            assert llm.served.plan.pages == 10
            assert tokens(llm, prompts, self.sampling("sampled")) == alone["sampled"]
        finally:
            close_even(llm)
