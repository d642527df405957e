"""The exactness gates through the lanes and the engine thread, on the gemma4 demo checkpoint
(fp32): concurrent == solo, n choices, pages == windows, poisoned == clean
(tensorfold.conformance). Prompts run past the demo's 128-row sliding window and past a 512-row
page. Every engine's census must be even when idle."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold.testing import close_even
from tensorfold_gemma4.demo import build_demo


class TestEngineGates(conformance.ChoicesGate):
    family, build_demo = "gemma4", build_demo
    context, lengths, ids = 2048, [5, 40, 150, 600, 1100], (13, 700)

    def test_the_plan_counts_pages_for_full_layers_and_rings_for_sliding_ones(self, demo):
        llm = self.open_llm(demo, parallel=2)
        try:
            layout = llm.served.engine.lanes.runner.model.layout
            # six layers, two of them KV-sharing: full layer 2 pages K and V (1 KV head x 64,
            # fp32); sliding layers 0, 1 and 3 keep rings of window - 1 = 127 rows (2 KV heads x
            # 32)
            assert [r.name for r in layout.paged] == ["L2.k", "L2.v"]
            assert layout.row_bytes == 2 * 64 * 4
            assert [s.name for s in layout.fixed] == [
                f"L{i}.{kv}" for i in (0, 1, 3) for kv in ("sk", "sv")
            ]
            assert {s.shape for s in layout.fixed} == {(127, 2, 32)}
            assert layout.fixed_bytes == 6 * 127 * 2 * 32 * 4
            plan = llm.served.plan
            assert plan.page_bytes == 512 * layout.row_bytes
            assert plan.fixed_bytes == layout.fixed_bytes
        finally:
            close_even(llm)
