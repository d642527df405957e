"""The verify-run promise on the GPU (`pytest -m gpu`): each family's demo checkpoint in bf16 on
CUDA, its Triton kernels (and fla-core's chunk kernel for glm5_next) compiled for the device.
A stream's token and k drafts fed as one run of k + 1 rows (logits "all", taps at every draft
row) give every row the logits plain one-row decoding gives it and tap at each draft row the
slot state plain decoding leaves, bit for bit (testing.assert_verify_rows_match): runs beside a
decode row and a prompt chunk, across page boundaries and 64-row chunk boundaries, rounds
rejecting drafts in turn and rolled back from their taps; plain decoding eager and replayed
from CUDA graphs (as served); pages in bf16 and in fp8; runs marked rewind as the lanes' are
(gemma4's taps then its rings' saved rows); glm5_next with each KDA switch off."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.runner import ModelRunner
from tensorfold.family.checkpoint import Checkpoint

pytestmark = pytest.mark.gpu

FAMILIES = {
    "lfm2_moe": "tensorfold_lfm2_moe",
    "gemma4": "tensorfold_gemma4",
    "glm5_next": "tensorfold_glm",
}
KS = (1, 3, 7, 8, 15, 31)  # runs of 2 .. 32 rows, under glm5_next's 64-row chunk
# (prompt rows, page rows): runs across 24-row pages and the chunk boundaries at 64 and 128;
# across a 512-row page and the chunk boundary at 512
CASES = ((58, 24), (120, 24), (500, 512))
TOKENS = 48


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def demo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(family name, the demo model in bf16 on CUDA)."""
    package = FAMILIES[request.param]
    folder: Path = importlib.import_module(f"{package}.demo").build_demo(
        tmp_path_factory.mktemp(request.param)
    )
    load = importlib.import_module(f"{package}.model").load
    return request.param, load(Checkpoint.open(folder), "cuda", "bfloat16")


def factory(model: Any, graphs: bool, kv_dtype: str = "auto") -> Callable[..., ModelRunner]:
    """make_runner for the checker: plain ModelRunners, or GraphRunners (one-row decode passes
    replayed from CUDA graphs; verify runs have taps, so they run eagerly)."""
    from tensorfold.engine.cuda_graphs import GraphRunner

    def make(num_pages: int, num_slots: int, page_rows: int = 512) -> ModelRunner:
        if graphs:
            return GraphRunner(
                model,
                num_pages=num_pages,
                num_slots=num_slots,
                page_rows=page_rows,
                kv_dtype=kv_dtype,
            )
        return ModelRunner(
            model, num_pages=num_pages, num_slots=num_slots, page_rows=page_rows, kv_dtype=kv_dtype
        )

    return make


def ids(model: Any, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, min(model.vocab_size, 700), (n,), generator=g).tolist()


def check(
    model: Any, graphs: bool, kv_dtype: str = "auto", ks=KS, cases=CASES, rewind: bool = False
) -> None:
    make = factory(model, graphs, kv_dtype)
    for rows, page_rows in cases:
        prompt, tokens = ids(model, rows, rows), ids(model, TOKENS, rows + 1)
        plain = testing.plain_rows(make, prompt, tokens, page_rows=page_rows)
        for k in ks:
            testing.assert_verify_rows_match(
                make, prompt, tokens, k, page_rows=page_rows, plain=plain, rewind=rewind
            )


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_verify_runs_equal_plain_decoding(demo, graphs):
    check(demo[1], graphs)


def test_verify_runs_equal_plain_decoding_with_fp8_kv(demo):
    check(demo[1], True, "fp8", ks=(3, 8), cases=CASES[:2])


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_rewind_runs_equal_plain_decoding(demo, kv_dtype):
    """Verify runs marked rewind (StreamRows.rewind), rolled back through runner.rewind_slot:
    gemma4 taps the ring rows each run overwrites, saved before its advance (RingRewinds), its
    127-row rings wrapped at 500 rows."""
    check(demo[1], True, kv_dtype, ks=(3, 8, 31), cases=CASES[1:], rewind=True)


@pytest.mark.parametrize("switch", ["OWN_RECURRENT", "KDA_TAIL_IN_PLACE"])
def test_glm_verify_runs_with_a_kda_switch_off(demo, switch):
    """fla-core's fused recurrent kernel (packed for a run, by slot index for a decode pass);
    a decode pass's conv tails moved by their own launch."""
    name, model = demo
    if name != "glm5_next":
        pytest.skip("glm5_next's switches")
    from tensorfold.ops import switches

    with switches.switched(getattr(switches, switch), False):
        check(model, True, ks=(1, 7, 31))
