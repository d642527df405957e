"""The warm-up at start (TF_WARM_UP; on for CUDA): it runs its prompts and decode rounds through
the lanes before the engine serves, and leaves nothing behind: the pool's census even, the
prompt store empty, the counters at zero, and a warmed engine's replies equal a cold one's."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (as the
# kernels' tests do: a kernel is interpreted or not from its import on)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tensorfold import testing
from tensorfold.engine import warm_up  # noqa: E402
from tensorfold.engine.sampling import SamplingParams  # noqa: E402
from tensorfold.ops import triton_attention  # noqa: E402
from tensorfold.ops import triton_key_split as key_split  # noqa: E402
from tensorfold.ops.pass_meta import QUERY_ROWS  # noqa: E402

PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=12),
    "sampled": SamplingParams(temperature=0.9, seed=3, max_tokens=12),
}
PROMPTS = ["Once upon a time", "The little engine that could", "Hello"]


@pytest.mark.parametrize("family", ["lfm2_moe", "gemma4", "glm5_next"])
def test_a_warmed_engine_answers_as_a_cold_one_and_keeps_nothing(family: str, tmp_path: Path):
    replies = {}
    for warm in (False, True):
        # a store that can keep what the warm-up's prompts leave at their marks
        llm = testing.open_llm(
            family,
            None,
            demo_cache=tmp_path,
            warm_up=warm,
            parallel=2,
            kv_share=8,
            prompt_cache_gib=0.05,
            draft="ngram",  # the warm-up's rounds draft too: their counts start from zero
        )
        try:
            lanes = llm.served.engine.lanes
            assert lanes.tokens_out == lanes.passes == lanes.rows_computed == 0
            assert lanes.tokens_drafted == lanes.drafts_accepted == lanes.verify_rounds == 0
            sharing = lanes.sharing
            assert sharing is not None and sharing.max_states > 0
            assert not list(sharing.store.kept())
            assert sharing.evictions == sharing.host_hits == 0
            assert lanes.pool.census().idle_even and lanes.uneven == 0
            replies[warm] = {
                name: [c.token_ids for c in llm.generate(PROMPTS, p)] for name, p in PARAMS.items()
            }
        finally:
            testing.close_even(llm)
    assert replies[True] == replies[False]


def test_the_warm_up_is_on_for_cuda_only_unless_asked(tmp_path: Path, monkeypatch):
    from tensorfold.engine import start

    ran = []
    monkeypatch.setattr(start, "warm_up", lambda lanes, vocab: ran.append(vocab))
    for flag, runs in ((None, False), (True, True), (False, False)):
        ran.clear()
        flags = {} if flag is None else {"warm_up": flag}
        llm = testing.open_llm("lfm2_moe", None, demo_cache=tmp_path, **flags)
        testing.close_even(llm)
        assert bool(ran) == runs, (flag, ran)


# (query heads, KV heads, head dim): LFM2's attention, gemma4's global and sliding layers
@pytest.mark.parametrize("hq, hkv, d", [(32, 8, 64), (16, 2, 512), (16, 8, 256)])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_lone_warm_up_prompt_shares_its_attention_keys(
    hq: int, hkv: int, d: int, fp8: bool
) -> None:
    """The warm-up's short prompt alone is a pass whose attention programs share its keys'
    segments (the split kernel and its combine), as a chat's next turn after a long kept prefix
    does: so that kernel is compiled before the server listens, in bf16 and fp8 rows."""
    qb, _, bdv = triton_attention.tiles(d, d, hq // hkv, fp8)
    rows = warm_up.ALONE[0]
    tiles = key_split.live_tiles(1, QUERY_ROWS // qb, rows, qb)
    assert key_split.parts_for(tiles * hkv * (d // bdv), segments=2) > 1
