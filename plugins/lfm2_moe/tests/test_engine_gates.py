"""The exactness gates through the lanes and the engine thread, on the demo checkpoint (fp32):
concurrent == solo, pages == windows, poisoned == clean, pool pressure, and a long fill that
short prompts don't wait behind. Every engine's census must be even when it goes idle."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tensorfold import conformance
from tensorfold.engine.requests import Finished, RequestRefused, TokenOut
from tensorfold.engine.sampling import SamplingParams
from tensorfold.memory.kv_plan import GiB, KiB
from tensorfold.testing import close_even, tokens
from tensorfold_lfm2_moe.demo import build_demo

GREEDY = conformance.greedy(10)
SAMPLED = conformance.seeded(1234, 10)


class TestEngineGates(conformance.EngineGates):
    family, build_demo = "lfm2_moe", build_demo
    lengths = [5, 17, 64, 200, 700, 1500, 2100, 2500]  # two longer than a 2048-row pass
    ids, max_tokens = (5, 700), 10
    parallel, levels = 8, (1, 2, 4, 8)
    page_flags = ({"kv_pages": "off"}, {"kv_poison": True}, {"kv_pages": "0"})

    def test_pool_pressure_makes_streams_wait_with_the_same_outputs(self, demo, prompts, alone):
        # A 4096-token window is 8 pages of 512 rows (512 KiB each in fp32). A room of 12 pages and
        # four lanes' fixed state (4 KiB each) plans 8 + 3 pages (a window and a page for each other
        # lane), and the cache (0) leaves one more: 12 pages, 6144 rows, for 8 prompts of up to
        # 2500 + 10 rows, so streams wait for pages.
        room = 12 * 512 * KiB + 4 * 4 * KiB
        llm = self.open_llm(demo, parallel=4, memory_limit_gib=room / GiB)
        try:
            assert llm.served.plan.pages == 12
            assert tokens(llm, prompts, SAMPLED) == alone["sampled"]
        finally:
            close_even(llm)

    def test_short_prompts_finish_before_a_long_fill(self, demo):
        llm = self.open_llm(demo, parallel=4, context=8192)
        engine = llm.served.engine
        done: list[str] = []
        finished = threading.Event()

        def sink(name):
            def put(event):
                if isinstance(event, Finished):
                    done.append(name)
                    if len(done) == 4:
                        finished.set()

            return put

        try:
            long_prompt = list(range(5, 405)) * 18  # 7200 rows: four passes of fill
            long_params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
            engine.submit(long_prompt, long_params, sink("long"))  # 30 tokens after its fill
            while engine.lanes.passes == 0:
                time.sleep(0.001)  # the long fill is under way
            for i in range(3):
                engine.submit([5 + i] * 20, GREEDY, sink(f"short{i}"))
            assert finished.wait(120)
            assert done[-1] == "long", done
        finally:
            close_even(llm)

    def test_a_request_over_the_window_is_refused_with_both_numbers(self, demo):
        llm = self.open_llm(demo, parallel=2)
        try:
            with pytest.raises(
                RequestRefused, match=r"4000 tokens plus max_tokens 200 make 4200.*4096"
            ):
                llm.generate([[5] * 4000], SamplingParams(max_tokens=200))
            top = llm.served.engine.lanes.runner.model.vocab_size - 1
            with pytest.raises(RequestRefused, match=rf"logit_bias key 9999 .* ids are 0\.\.{top}"):
                llm.generate([[5] * 10], SamplingParams(logit_bias={9999: 1}))  # not a failed pass
            assert llm.generate([[5] * 10], GREEDY)[0].finish_reason == "length"
        finally:
            close_even(llm)

    def test_a_biased_row_among_others_equals_it_alone(self, demo, prompts):
        """logit_bias is applied to its own row only: a strong bias changes the tokens, and the
        biased request gets the same tokens alone as batched with unbiased ones (greedy and
        seeded, whose greedy rows the lanes otherwise sample together)."""
        favoured = {t: 6.0 for t in range(300, 340)}
        llm = self.open_llm(demo, parallel=4)
        try:
            for base in (GREEDY, SAMPLED):
                biased = SamplingParams(**{**vars(base), "logit_bias": favoured})
                plain_alone = tokens(llm, [prompts[2]], base)[0]
                alone = tokens(llm, [prompts[2]], biased)[0]
                assert alone != plain_alone
                assert sum(300 <= t < 340 for t in alone) > sum(300 <= t < 340 for t in plain_alone)
                batch = [prompts[0], prompts[2], prompts[1], prompts[3]]
                got = llm.generate(batch, [base, biased, base, base])
                assert got[1].token_ids == alone
        finally:
            close_even(llm)

    def test_cancel_frees_the_lane_and_pages_in_the_next_round(self, demo):
        llm = self.open_llm(demo, parallel=1)
        engine = llm.served.engine
        events: list = []
        first = threading.Event()
        ended = threading.Event()

        def sink(event):
            events.append(event)
            if isinstance(event, TokenOut):
                first.set()
            if isinstance(event, Finished):
                ended.set()

        try:
            req = engine.submit([5] * 30, SamplingParams(temperature=0, max_tokens=3000), sink)
            assert first.wait(30)
            engine.cancel(req)
            assert ended.wait(30)
            assert events[-1].reason == "cancelled"
            # the lane is free again: a second request runs at once
            assert llm.generate([[6] * 8], GREEDY)[0].finish_reason == "length"
        finally:
            close_even(llm)

    def test_constrained_rows_concurrent_equal_solo(self, demo, prompts):
        """Structured output on: every row masked by its own matcher gives, all eight at once (long
        prompts cut across passes among them; greedy and seeded rows mixed), the tokens it gives
        alone; the replies are JSON of the schema, and the census is even after."""
        from tensorfold.engine.structured import json_schema

        schema = {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "n": {"type": "integer", "minimum": 0, "maximum": 999},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            },
            "required": ["name", "n"],
            "additionalProperties": False,
        }
        llm = self.open_llm(demo, parallel=8)
        try:
            constraint = json_schema(schema, llm.tokenizer)
            mixed = [
                SamplingParams(
                    **{
                        **vars(GREEDY if i % 3 == 0 else SAMPLED),
                        "seed": 50 + i,
                        "ignore_eos": False,
                        "max_tokens": 60,
                        "constraint": constraint,
                    }
                )
                for i in range(len(prompts))
            ]
            alone = [llm.generate([p], params)[0] for p, params in zip(prompts, mixed)]
            together = llm.generate(prompts, mixed)
            assert [c.token_ids for c in together] == [c.token_ids for c in alone]
            for c in alone:
                assert c.finish_reason == "stop" and set(json.loads(c.text)) >= {"name", "n"}
        finally:
            close_even(llm)
