"""gemma4 with fp8 KV pages and rings (TF_KV_DTYPE=fp8: its full layers' K/V and its sliding
layers' rings) on the demo checkpoint (fp32): every gate holds bit for bit within fp8 (concurrent
== solo, pages == windows with poisoned freed pages, resumed == fresh past the sliding window,
from the device store and from the host tier), and fp8 stays close to fp32 KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold_gemma4.demo import build_demo

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def test_gates_hold_within_fp8_kv(demo: Path) -> None:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(13, 700, (n,), generator=g).tolist() for n in (9, 200, 600, 2100)]
    chats = [testing.chat_turns(c, turns=2, first=150, later=20) for c in range(3)]
    # resumed == fresh past the demo's 128-row sliding window: the kept rings carry the resume
    testing.assert_engine_gates(
        "gemma4",
        demo,
        prompts,
        chats,
        GREEDY,
        SAMPLED,
        min_cached=150,
        kv_dtype="fp8",
        context=4096,
        parallel=4,
    )


def test_fp8_states_resumed_from_the_host_tier_give_the_fresh_replies(demo: Path) -> None:
    chats = [testing.chat_turns(c, turns=3, first=60, later=20) for c in range(6)]
    testing.assert_host_tier_resumes_as_fresh(
        "gemma4", demo, chats, SAMPLED, kv_dtype="fp8", context=4096
    )


def test_fp8_kv_agrees_with_fp32_kv_and_the_demo_still_writes_words(demo: Path) -> None:
    # q/k-normed scores at scale 1.0: a wider logit error than the other families'
    print(testing.assert_demo_agrees_in_kv_dtype("gemma4", demo, "fp8", 0.2))
