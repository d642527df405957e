"""The exactness gates through the lanes and the engine thread, on the gemma4 demo checkpoint
(fp32): concurrent == solo, pages == windows, poisoned == clean. Prompts run past the demo's
128-row sliding window and past a 512-row page. Every engine's census must be even when idle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.testing import close_even, tokens
from tensorfold_gemma4.demo import build_demo

CONTEXT = 2048
LENGTHS = [5, 40, 150, 600, 1100]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(13, 700, (n,), generator=g).tolist() for n in LENGTHS]


def open_llm(demo: Path, **flags) -> LLM:
    return testing.open_llm("gemma4", demo, **{"context": CONTEXT, **flags})


@pytest.fixture(scope="module")
def alone(demo: Path, prompts) -> dict[str, list[list[int]]]:
    """Each prompt run by itself, greedy and seeded."""
    llm = open_llm(demo, parallel=1)
    try:
        return testing.tokens_alone(llm, prompts, {"greedy": GREEDY, "sampled": SAMPLED})
    finally:
        close_even(llm)


@pytest.mark.parametrize("params_name", ["greedy", "sampled"])
def test_concurrent_equals_solo(demo, prompts, alone, params_name):
    params = {"greedy": GREEDY, "sampled": SAMPLED}[params_name]
    llm = open_llm(demo, parallel=len(prompts))
    try:
        testing.assert_concurrent_equals_solo(
            llm, prompts, params, alone[params_name], levels=(2, len(prompts))
        )
    finally:
        close_even(llm)


def test_n_choices_equal_their_single_twins(demo, prompts):
    """n = 3 choices fork from one prompt pass (pages shared, fixed state copied); poisoned
    freed pages, so a choice reading a page its prompt's stream gave back would change."""
    llm = open_llm(demo, parallel=4, kv_poison=True)
    try:
        testing.assert_choices_equal_single_twins(llm, prompts[2:4], SAMPLED, n=3)
    finally:
        close_even(llm)


@pytest.mark.parametrize("flags", [{"kv_pages": "off"}, {"kv_poison": True}])
def test_pages_equal_windows_and_poisoned_equals_clean(demo, prompts, alone, flags):
    llm = open_llm(demo, parallel=len(prompts), **flags)
    try:
        if flags.get("kv_pages") == "off":
            assert llm.served.plan.mode == "windows"
        assert tokens(llm, prompts, SAMPLED) == alone["sampled"]
    finally:
        close_even(llm)


def test_the_plan_counts_pages_for_full_layers_and_rings_for_sliding_ones(demo):
    llm = open_llm(demo, parallel=2)
    try:
        layout = llm.served.engine.lanes.runner.model.layout
        # six layers, two of them KV-sharing: full layer 2 pages K and V (1 KV head x 64, fp32);
        # sliding layers 0, 1 and 3 keep rings of window - 1 = 127 rows (2 KV heads x 32)
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
