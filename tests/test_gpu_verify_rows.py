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


def graphed_runner(model: Any, runners: list) -> Callable[..., ModelRunner]:
    """GraphRunners whose verify runs replay (1, R) graphs where the family has verify graphs;
    each one made is appended to `runners`."""
    from tensorfold.engine.cuda_graphs import GraphRunner

    def make(num_pages: int, num_slots: int, page_rows: int = 512) -> ModelRunner:
        runners.append(
            GraphRunner(model, num_pages=num_pages, num_slots=num_slots, page_rows=page_rows)
        )
        return runners[-1]

    return make


@pytest.mark.parametrize("kv_dtype", ["auto"])
def test_verify_graphs_equal_plain_decoding(demo, kv_dtype):
    """Verify runs alone in their pass (as a uniform verify pass is), rewind-marked, through
    captured (1, R) graphs where the family has them: plain's logits and taps, bit for bit."""
    from tensorfold.engine.cuda_graphs import VERIFY_ROWS

    _, model = demo
    for rows, page_rows in CASES[:2]:
        prompt, tokens = ids(model, rows, rows), ids(model, TOKENS, rows + 1)
        plain = testing.plain_rows(factory(model, True), prompt, tokens, page_rows=page_rows)
        for r in VERIFY_ROWS:
            runners: list = []
            testing.assert_verify_rows_match(
                graphed_runner(model, runners),
                prompt,
                tokens,
                r - 1,
                page_rows=page_rows,
                plain=plain,
                beside=False,
                rewind=True,
            )
            runner = runners[0]
            assert runner.capture_error is None, runner.capture_error
            if model.verify_graphs:
                assert (1, r) in runner.graphs and runner.graphs[(1, r)].graph is not None


def test_lanes_through_verify_graphs_equal_plain(demo):
    """The lanes over a GraphRunner, predictions perfect, wrong and none at four streams, greedy
    and seeded: every stream's tokens are plain's; the family's verify rounds replay graphs."""
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.engine.drafts import DraftSettings
    from tensorfold.engine.lanes import Lanes
    from tensorfold.engine.requests import Request, TokenOut
    from tensorfold.engine.sampling import SamplingParams

    _, model = demo
    prompts = [ids(model, n, n) for n in (40, 70, 9, 130)]
    seeded = SamplingParams(
        temperature=0.8, top_p=0.9, seed=3, repetition_penalty=1.1, max_tokens=24, ignore_eos=True
    )
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), seeded):

        def go(predictions, drafts, graphs=True):
            runner = (GraphRunner if graphs else ModelRunner)(
                model, num_pages=8, num_slots=4, page_rows=512
            )
            lanes = Lanes(runner, lanes=4, window=1024, drafts=drafts)
            outs: list[list[int]] = [[] for _ in prompts]
            for i, p in enumerate(prompts):
                lanes.add(
                    Request(
                        p,
                        params,
                        lambda e, o=outs[i]: o.append(e.token) if isinstance(e, TokenOut) else None,
                        prediction=tuple(predictions[i]),
                    )
                )
            while lanes.step():
                pass
            assert lanes.pool.census().idle_even
            return outs, runner

        plain, _ = go([()] * 4, DraftSettings(), graphs=False)
        wrong = [(t + 1) % model.vocab_size for t in plain[1]]
        got, runner = go([plain[0], wrong, (), plain[3]], DraftSettings(adaptive=False))
        assert got == plain
        if model.verify_graphs:
            assert any(r > 1 for _, r in runner.graphs), list(runner.graphs)
