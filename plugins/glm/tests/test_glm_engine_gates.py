"""The exactness gates through the lanes and the engine thread, on the demo checkpoint (fp32):
concurrent == solo, pages == windows, poisoned == clean, and pool pressure. Every engine's census
must be even when it goes idle."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold.llm import LLM
from tensorfold.memory.kv_plan import GiB
from tensorfold.testing import close_even, tokens
from tensorfold_glm.demo import build_demo

CONTEXT = 4096
LENGTHS = [5, 17, 90, 700, 2100]  # past the sparse-selection point; one longer than a pass
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(20, 800, (n,), generator=g).tolist() for n in LENGTHS]


def open_llm(demo: Path, **flags) -> LLM:
    return testing.open_llm("glm5_next", demo, **{"context": CONTEXT, **flags})


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
    llm = open_llm(demo, parallel=5)
    try:
        testing.assert_concurrent_equals_solo(
            llm, prompts, params, alone[params_name], levels=(2, 5)
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
    llm = open_llm(demo, parallel=5, **flags)
    try:
        if flags.get("kv_pages") == "off":
            assert llm.served.plan.mode == "windows"
        assert tokens(llm, prompts, SAMPLED) == alone["sampled"]
    finally:
        close_even(llm)


def test_pool_pressure_makes_streams_wait_with_the_same_outputs(demo, prompts, alone):
    layout = llm_layout(demo)
    page = 512 * layout.row_bytes
    # A 4096-token window is 8 pages; three lanes plan 8 + 2 pages (a window and a page for
    # each other lane): 5120 rows for five prompts of up to 2100 + 8 rows, so streams wait.
    room = 10 * page + 3 * layout.fixed_bytes
    llm = open_llm(demo, parallel=3, memory_limit_gib=room / GiB)
    try:
        assert llm.served.plan.pages == 10
        assert tokens(llm, prompts, SAMPLED) == alone["sampled"]
    finally:
        close_even(llm)


def llm_layout(demo: Path):
    import json

    from tensorfold_glm.layout import shape

    return shape(json.loads((demo / "config.json").read_text()), "float32").layout
