"""lfm2_moe with fp8 KV pages (TF_KV_DTYPE=fp8) on the demo checkpoint (fp32): every gate holds
bit for bit within fp8 (concurrent == solo, pages == windows with poisoned freed pages, resumed
== fresh, from the device store and from the host tier), and fp8 stays close to fp32 KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams
from tensorfold_lfm2_moe.demo import build_demo

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_demo(tmp_path_factory.mktemp("demo"))


def test_gates_hold_within_fp8_kv(demo: Path) -> None:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 700, (n,), generator=g).tolist() for n in (9, 130, 600, 2100)]
    chats = [testing.chat_turns(c, turns=2, first=150, later=20) for c in range(3)]
    testing.assert_engine_gates(
        "lfm2_moe",
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
        "lfm2_moe", demo, chats, SAMPLED, kv_dtype="fp8", context=4096
    )


def test_fp8_kv_agrees_with_fp32_kv_and_the_demo_still_writes_words(demo: Path) -> None:
    print(testing.assert_demo_agrees_in_kv_dtype("lfm2_moe", demo, "fp8", 0.05))
