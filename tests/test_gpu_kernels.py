"""The GPU suite's kernel checks (`pytest -m gpu`, on a CUDA machine), in bf16 on the device:

- the shared kernels (linear, MoE, gated FFN, router, norms, rope): a row alone gives the bits it
  gives in batches of every size, across the tile choice by row count; attention's key segments
  walked by one program or shared by several give the same bits;
- each family's model on its demo checkpoint, through all of its kernels: streams in one pass
  (a decode row, a chunk, a whole prompt) give the logits they give alone, bit for bit; shuffled
  page tables and poisoned free pages change nothing; the graph runner's decode rounds equal
  plain passes.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.ops import switches

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
ROWS = [1, 2, 3, 7, 16, 33, 255, 256, 257, 700]  # both sides of the small-tile limit (256)
FAMILIES = {
    "lfm2_moe": "tensorfold_lfm2_moe",
    "gemma4": "tensorfold_gemma4",
    "glm5_next": "tensorfold_glm",
}


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, BF16)


def assert_rows_invariant(fn, x: torch.Tensor, *row_args: torch.Tensor) -> None:
    """fn over the first m rows, for every m in ROWS, gives each row the bits of the full batch."""
    full = fn(x, *row_args)
    full = full if isinstance(full, tuple) else (full,)
    for m in ROWS:
        for start in {0, x.shape[0] - m}:
            part = fn(
                x[start : start + m].clone(), *[a[start : start + m].clone() for a in row_args]
            )
            part = part if isinstance(part, tuple) else (part,)
            for p, f in zip(part, full):
                assert torch.equal(p, f[start : start + m]), f"rows {start}:{start + m}"


def test_linear_rows_alone_equal_batches():
    from tensorfold.ops import triton_linear

    w, b = randn(1100, 320, seed=1, scale=0.05), randn(1100, seed=2)
    assert_rows_invariant(lambda x: triton_linear.linear(x, w, b), randn(700, 320, seed=3))


def test_rms_norm_with_an_fp32_weight_rows_alone_and_near_the_reference():
    """norms.rms_norm(fp32_weight=True): one launch, rows alone == batches, within bf16 rounding
    of the torch reference (the GPU's sum of squares runs in another order)."""
    from tensorfold.ops import norms

    w = randn(2048, seed=7, scale=0.1) + 1
    x = randn(700, 2048, seed=8)
    assert_rows_invariant(lambda x: norms.rms_norm(x, w, 1e-6, fp32_weight=True), x)
    got = norms.rms_norm(x, w, 1e-6, fp32_weight=True).cpu()
    want = norms.rms_norm(x.cpu(), w.cpu(), 1e-6, fp32_weight=True)  # the torch reference
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


def test_linear_groups_rows_alone_equal_batches():
    """GLM-5.3-Flash's f_b and g_b (2 x [8192, 128]) of adjacent columns of its x maps' product
    (a [M, 576] pass) in one launch: rows alone == batches, near each group's own product."""
    from tensorfold.ops import triton_linear

    w = randn(2 * 8192, 128, seed=55, scale=0.05)
    maps = randn(700, 576, seed=56)

    def run(m):
        return triton_linear.linear_groups(m[:, :256], w, 2).transpose(0, 1)

    assert_rows_invariant(run, maps)
    got = run(maps)
    for g in range(2):
        want = triton_linear.linear(
            maps[:, g * 128 : (g + 1) * 128].contiguous(), w[g * 8192 : (g + 1) * 8192]
        )
        assert (got[:, g].float() - want.float()).abs().max() < 0.02 * want.float().abs().max()


@pytest.mark.parametrize("h, i, e, k", [(256, 192, 16, 4), (512, 1792, 16, 4), (256, 192, 128, 8)])
def test_moe_gated_ffn_and_router_rows_alone_equal_batches(h, i, e, k):
    """The experts, the dense FFN, the router and a few rows routed then through the experts:
    rows alone == batches. 1792 wide (LONG_K or more): a few rows' down kernel walks K in
    128-long steps, a prompt pass's in 64-long ones; on the GPU the bits are the same (the MMAs
    chain one accumulator). 128 experts, top 8: passes of 33 rows (2 pairs an expert) take the
    few rows' 16-row blocks, passes of 255 their 64-row blocks."""
    from tensorfold.ops import moe as ref_moe
    from tensorfold.ops import triton_moe, triton_route

    if e == 128:
        assert triton_moe.pick(33, i, 33 * k, e)[0] == triton_moe.TINY_BLOCK_M
        assert triton_moe.pick(255, i, 255 * k, e)[0] == triton_moe.SMALL_BLOCK_M
    wide = i >= triton_moe.LONG_K
    assert triton_moe.pick(1, i)[2] == (
        triton_moe.TINY_LONG_DOWN_TILES if wide else triton_moe.TINY_DOWN_TILES
    )
    w1 = list(randn(e, i, h, seed=4, scale=0.05).unbind(0))
    w3 = list(randn(e, i, h, seed=5, scale=0.05).unbind(0))
    w2 = list(randn(e, h, i, seed=6, scale=0.05).unbind(0))
    gate = randn(e, h, seed=7, scale=0.05)
    x = randn(700, h, seed=8)
    weights, experts = ref_moe.route(x, gate, None, k, norm_topk_prob=True)
    assert_rows_invariant(
        lambda x, wt, ex: triton_moe.moe(x, wt, ex, w1, w3, w2), x, weights, experts
    )
    d = 2 * i
    d1, d3, d2 = (
        randn(d, h, seed=9, scale=0.05),
        randn(d, h, seed=10, scale=0.05),
        randn(h, d, seed=11, scale=0.05),
    )
    assert_rows_invariant(lambda x: triton_moe.gated_ffn(x, d1, d3, d2), x)
    eb = randn(e, seed=12, scale=0.1).float()
    assert_rows_invariant(
        lambda x: triton_route.route(x, gate, eb, k, norm_topk_prob=True, scaling=2.5), x
    )

    def routed_moe(x):  # a few rows: the router's program sorts the pairs (no align launch)
        wt, ex = triton_route.route(x, gate, eb, k, norm_topk_prob=True, scaling=2.5)
        return triton_moe.moe(x, wt, ex, w1, w3, w2)

    assert_rows_invariant(routed_moe, x)


@pytest.mark.parametrize("i, h", [(2112, 2816), (7168, 2048)])
def test_dense_ffn_on_its_own_tiles_rows_alone_equal_batches(i, h):
    """DENSE_TILES: gemma4's and lfm2's dense FFN, whose decode-sized passes have their own tiles
    (16 or 32 columns, 128-long k steps), its products' K in chunks (a program a chunk up to
    DENSE_SPLIT_ROWS rows; the 700-row pass on the walk class's tiles): rows alone == batches,
    across every row class."""
    from tensorfold.ops import triton_moe

    assert (i, h, "small") in triton_moe.DENSE_TILES and (i, h, "walk") in triton_moe.DENSE_TILES
    assert triton_moe.dense_splits(i, h) > 1
    w1, w3 = randn(i, h, seed=30, scale=0.05), randn(i, h, seed=31, scale=0.05)
    w2 = randn(h, i, seed=32, scale=0.05)
    assert_rows_invariant(lambda x: triton_moe.gated_ffn(x, w1, w3, w2), randn(700, h, seed=33))


def test_route_a_program_a_row_gives_the_rows_tiles_bits():
    """Passes routed a program a row on the one-row tile (gemma4's softmax over 128 experts,
    top 8; the sigmoid route of 32, top 4): rows alone have the bits of batches, those of a few
    rows routed ROUTE_ROWS rows a program in four warps among them."""
    from tensorfold.ops import triton_route

    gate = randn(128, 2816, seed=45, scale=0.02)
    scale = (1 + randn(128, seed=46, scale=0.1)).float()
    few, eb = randn(32, 2816, seed=47, scale=0.02), randn(32, seed=48, scale=0.1).float()
    x = randn(700, 2816, seed=49)
    runs = (
        lambda x: triton_route.softmax_route(x, gate, 8, scale),
        lambda x: triton_route.route(x, few, eb, 4, norm_topk_prob=True, scaling=2.5),
    )
    for run in runs:
        assert_rows_invariant(run, x)


@pytest.mark.parametrize("h", [2048, 512])
def test_norm_in_the_routers_launch_gives_the_norms_bits(h):
    """norm_route: a row alone (the add + RMSNorm in the router's one launch) has the bits of
    the same row in a batch (add_rms_norm's own launch, then the router's)."""
    from tensorfold.ops import triton_route

    nw = (1 + randn(h, seed=17, scale=0.1).float() * 0.1).to(BF16)
    gate, eb = randn(32, h, seed=18, scale=0.05), randn(32, seed=19, scale=0.1).float()
    assert_rows_invariant(
        lambda y, r: triton_route.norm_route(
            y, r, nw, 1e-5, gate, eb, 4, norm_topk_prob=True, scaling=2.5
        ),
        randn(700, h, seed=20),
        randn(700, h, seed=21),
    )


def test_route_of_one_row_on_its_own_tile_gives_the_rows_tiles_bits():
    """gemma4's routing (softmax over 128 experts, top 8, per-expert scale) of a
    row alone, on a [1, 128] tile in one warp, has the bits of the row in a batch ([16, 128]
    tiles in four warps), the sigmoid route's too, and lfm2's one-launch router of 32 experts
    on a [1, 32] tile."""
    from tensorfold.ops import triton_route

    gate = randn(128, 2816, seed=40, scale=0.02)
    scale = (1 + randn(128, seed=41, scale=0.1)).float()
    x = randn(700, 2816, seed=42)
    assert not triton_route.fuses_one_row(1, 128)
    assert_rows_invariant(lambda x: triton_route.softmax_route(x, gate, 8, scale), x)
    assert_rows_invariant(
        lambda x: triton_route.route(x, gate, None, 8, norm_topk_prob=True, scaling=2.5), x
    )
    few, eb = randn(32, 2816, seed=43, scale=0.02), randn(32, seed=44, scale=0.1).float()
    assert triton_route.fuses_one_row(1, 32)  # the one-launch router, sigmoid, on [1, 32]
    assert_rows_invariant(
        lambda x: triton_route.route(x, few, eb, 4, norm_topk_prob=True, scaling=2.5), x
    )


def test_fp32_router_on_a_columns_major_gate_rows_alone_equal_batches():
    """An fp32 router at GLM-5.3-Flash's width (256 experts in 8 groups, top 8), its gate
    stored transposed (_router_chain_kernel, on a one-row tile for one row): rows alone ==
    batches, and the experts of the row-major gate's tiled kernel where no keys are near-tied."""
    from tensorfold.ops import triton_route

    gate = (torch.randn(256, 4096, generator=torch.Generator().manual_seed(45)) * 0.02).to(DEV)
    cols = triton_route.columns_major(gate)
    eb = randn(256, seed=46, scale=0.01).float()
    x = randn(700, 4096, seed=47)

    def run(x, g=cols):
        return triton_route.route(
            x,
            g,
            eb,
            8,
            norm_topk_prob=True,
            scaling=2.5,
            fp32=True,
            norm_eps=1e-20,
            groups=8,
            keep_groups=4,
            by_expert=True,
        )

    assert_rows_invariant(run, x)
    same = (run(x)[1] == run(x, gate)[1]).all(-1)
    assert same.float().mean() > 0.9


def test_expand_and_collapse_in_one_launch_give_the_two_steps_bits():
    """FUSED_EXPAND_COLLAPSE, on: at GLM-5.3-Flash's width (4 streams of 4096) a few rows' expand
    and next collapse in one launch give the bits of expand then collapse_norm over 64 rows (their
    three launches)."""
    from tensorfold_glm import triton_mhc

    n, hc, h = 64, 4, 4096
    g = torch.Generator().manual_seed(51)
    post = (torch.rand(n, hc, generator=g) * 2).to(DEV)
    comb = torch.softmax(torch.randn(n, hc, hc, generator=g), -1).to(DEV)
    y, res = randn(n, h, seed=52), randn(n, hc, h, seed=53)
    fn = (torch.randn(24, hc * h, generator=g) * 0.004).to(DEV)
    base, scale = (torch.randn(24, generator=g) * 0.5).to(DEV), (torch.rand(3) + 0.5).to(DEV)
    norm_w = randn(h, seed=54, scale=0.2) + 1
    kw = dict(iters=20, rms_eps=1e-6, hc_eps=1e-6, norm_eps=1e-6)

    def fused(rows):
        return triton_mhc.expand_collapse_norm(
            post[rows], comb[rows], y[rows], res[rows], fn, base, scale, norm_w, **kw
        )

    streams = triton_mhc.expand(post, comb, y, res)
    two_steps = (streams, *triton_mhc.collapse_norm(streams, fn, base, scale, norm_w, **kw))
    assert switches.FUSED_EXPAND_COLLAPSE.on()
    for rows in ([0], [63], [5, 6], list(range(8)), [3, 9, 20, 31, 40, 50, 60, 62]):
        for got, want in zip(fused(rows), two_steps):
            assert torch.equal(got, want[rows]), rows


def test_kda_decode_tails_moved_on_in_the_convs_launch_equal_the_tail_kernels():
    """KDA_TAIL_IN_PLACE, both values, at GLM-5.3-Flash's KDA width (3 x 8192 channels, kernel 4): a
    decode pass of 64 streams (two fresh) gives the outputs and leaves the tails of the conv's
    launch then tail_kernel's, bit for bit."""
    from tensorfold.family.forward_pass import ForwardPass, StreamRows
    from tensorfold.ops.pass_meta import build_meta
    from tensorfold_glm import triton_kda

    n, d, k = 64, 8192, 4
    fp = ForwardPass(
        [StreamRows(s, 0 if s in (3, 40) else 100 + s, [1], [0], "all") for s in range(n)], 512, DEV
    )
    meta = build_meta(fp)
    qkv, tails = randn(n, 3 * d, seed=70), randn(n + 1, 3 * d, k - 1, seed=71)
    w = randn(3 * d, k, seed=72, scale=0.5).float()

    def run(in_place: bool):
        moved = tails.clone()
        with switches.switched(switches.KDA_TAIL_IN_PLACE, in_place):
            return triton_kda.conv_silu(qkv, moved, meta, w, d, one_row_each=True), moved

    (out, moved), (want, want_tails) = run(True), run(False)
    assert torch.equal(out, want) and torch.equal(moved, want_tails)


def test_kda_recurrent_rows_alone_equal_batches_and_fla_cores():
    """triton_kda.recurrent at GLM-5.3-Flash's KDA width (64 heads of 128): 64 decode rows
    (their streams' states in slots, two fresh) in one launch; each row alone gives its bits and
    its slot's state; a 5-row run == its rows one launch at a time; all near fla-core's
    fused_recurrent_kda on the same inputs (its own arithmetic order)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from tensorfold_glm import triton_kda

    n, heads, dk = 64, 64, 128
    q, k, v, pre = (randn(n, heads * dk, seed=60 + i) for i in range(4))
    b = randn(n, heads, seed=64)
    g = torch.Generator().manual_seed(65)
    a_log = (torch.rand(heads, generator=g) * 2.7).to(DEV)
    dt_bias = (torch.randn(heads * dk, generator=g) * 0.5).to(DEV)
    start = (torch.randn(n + 1, heads, dk, dk, generator=g) * 0.1).to(DEV)
    pos = torch.tensor([0 if r in (3, 40) else 100 + r for r in range(n)], dtype=torch.int32)
    i32 = lambda x: torch.as_tensor(x, dtype=torch.int32, device=DEV)  # noqa: E731

    def run(rows, lens=None):
        states, out = start.clone(), torch.zeros(n, heads, dk, dtype=BF16, device=DEV)
        triton_kda.recurrent(
            q,
            k,
            v,
            pre,
            b,
            a_log,
            dt_bias,
            -5.0,
            states,
            i32(rows),
            i32(lens or [1] * len(rows)),
            pos.to(DEV)[rows],
            i32(rows),
            out,
        )
        return out, states

    together = run(list(range(n)))
    for r in (0, 3, 17, 40, 63):
        out, states = run([r])
        assert torch.equal(out[r], together[0][r]) and torch.equal(states[r], together[1][r])
    whole = start.clone(), torch.zeros(n, heads, dk, dtype=BF16, device=DEV)
    triton_kda.recurrent(
        q,
        k,
        v,
        pre,
        b,
        a_log,
        dt_bias,
        -5.0,
        whole[0],
        i32([10]),
        i32([5]),
        i32([100]),
        i32([64]),
        whole[1],
    )
    steps = start.clone(), torch.zeros(n, heads, dk, dtype=BF16, device=DEV)
    for r in range(10, 15):
        triton_kda.recurrent(
            q,
            k,
            v,
            pre,
            b,
            a_log,
            dt_bias,
            -5.0,
            steps[0],
            i32([r]),
            i32([1]),
            i32([90 + r]),
            i32([64]),
            steps[1],
        )
    assert torch.equal(whole[0][64], steps[0][64]) and torch.equal(whole[1], steps[1])

    states = start.clone()
    states[3].zero_()
    states[40].zero_()
    out = torch.empty(n, 1, heads, dk, dtype=BF16, device=DEV)
    fused_recurrent_kda_fwd(
        q=q.view(n, 1, heads, dk),
        k=k.view(n, 1, heads, dk),
        v=v.view(n, 1, heads, dk),
        g=pre.view(n, 1, heads, dk),
        beta=torch.sigmoid(b.float()).to(BF16).view(n, 1, heads),
        initial_state=states,
        inplace_final_state=True,
        ssm_state_indices=i32(list(range(n))),
        out=out,
        A_log=a_log,
        dt_bias=dt_bias,
        scale=dk**-0.5,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        lower_bound=-5.0,
    )
    err = (out.view(n, heads, dk).float() - together[0].float()).norm() / out.float().norm()
    assert err < 2e-2, err
    assert ((states[:n] - together[1][:n]).norm() / states[:n].norm()) < 1e-3


def test_norms_and_rope_rows_alone_equal_batches():
    from tensorfold.ops import rope as ref_rope
    from tensorfold.ops import triton_norms, triton_rope

    w = (1 + randn(512, seed=13, scale=0.1).float() * 0.1).to(BF16)
    x, r = randn(700, 512, seed=14), randn(700, 512, seed=15)
    assert_rows_invariant(lambda x: triton_norms.rms_norm(x, w, 1e-5), x)
    assert_rows_invariant(lambda x, r: triton_norms.add_rms_norm(x, r, w, 1e-5), x, r)
    pos = torch.arange(700, device=DEV) * 7
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(64, 1e6).to(DEV), BF16)
    q = randn(700, 8, 64, seed=16)
    assert_rows_invariant(lambda q, c, s: triton_rope.apply_rope(q, c, s), q, cos, sin)


def test_qkv_norm_rope_write_rows_alone_equal_batches_and_the_launches_it_replaces():
    """lfm2's q/k norm + rope with its K/V row writes in one launch, at LFM2-8B-A1B's heads: a
    row alone gives the bits it gives in batches, and the bits of norm_rope's launch for q and
    for k and the copies."""
    from tensorfold.ops import rope as ref_rope
    from tensorfold.ops import triton_rope

    hq, hkv, d, n = 32, 8, 64, 700
    qkv = randn(n, hq + 2 * hkv, d, seed=17)
    q_norm, k_norm = 1 + randn(d, seed=18, scale=0.1), 1 + randn(d, seed=19, scale=0.1)
    pos = torch.arange(n, device=DEV) * 7
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(d, 1e6).to(DEV), BF16)
    index = torch.randperm(2 * n, generator=torch.Generator().manual_seed(20))[:n].to(DEV)

    def fused(qkv, cos, sin, index):
        k_rows = torch.zeros(2 * n, hkv, d, dtype=BF16, device=DEV)
        v_rows = torch.zeros_like(k_rows)
        q = triton_rope.qkv_norm_rope_write(
            qkv, q_norm, k_norm, 1e-5, cos, sin, k_rows, v_rows, index
        )
        return q, k_rows[index], v_rows[index]

    assert_rows_invariant(fused, qkv, cos, sin, index)
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    want = (
        triton_rope.norm_rope(q, q_norm, 1e-5, cos, sin, False),
        triton_rope.norm_rope(k, k_norm, 1e-5, cos, sin, False),
        v,
    )
    for got, w in zip(fused(qkv, cos, sin, index), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("hq, hkv, d, k_eq_v", [(16, 8, 256, False), (16, 2, 512, True)])
def test_qkv_heads_rows_alone_equal_batches_and_the_launches_they_replace(hq, hkv, d, k_eq_v):
    """gemma4's q/k/v heads in one launch, at Gemma-4-26B-A4B's sliding and full layers: a row
    alone gives the bits it gives in batches; q's bits are norm_rope's launch's, and k's too
    where that launch takes q's warps (the sliding layers); v within rounding of the norm."""
    from tensorfold.ops import rope as ref_rope
    from tensorfold.ops import triton_rope

    n = 700
    heads = randn(n, hq + hkv * (1 if k_eq_v else 2), d, seed=21, scale=3.0)
    q_norm, k_norm = (1 + randn(d, seed=s, scale=0.1).float() for s in (22, 23))
    pos = torch.arange(n, device=DEV) * 7
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(d, 1e6).to(DEV), BF16)
    v_first = hq if k_eq_v else hq + hkv

    def fused(heads, cos, sin):
        return triton_rope.qkv_heads(heads, hq, hkv, v_first, q_norm, k_norm, 1e-6, cos, sin)

    assert_rows_invariant(fused, heads, cos, sin)
    q, k, v = fused(heads, cos, sin)
    assert torch.equal(q, triton_rope.norm_rope(heads[:, :hq], q_norm, 1e-6, cos, sin, True))
    k_alone = triton_rope.norm_rope(heads[:, hq : hq + hkv], k_norm, 1e-6, cos, sin, True)
    if triton_rope._warps(hkv, d, 2) == triton_rope._warps(hq, d, 2):
        assert torch.equal(k, k_alone)
    else:
        assert (k.float() - k_alone.float()).abs().max() <= 0.02 * k_alone.float().abs().max()
    vf = heads[:, v_first : v_first + hkv].float()
    v_want = vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (v.float() - v_want).abs().max() <= 0.01 * v_want.abs().max()


def test_gemma4_residual_with_the_router_inputs_rows_alone_equal_batches():
    """gemma4's post-attention residual with the MoE's router and experts' inputs in its launch,
    at Gemma-4-26B-A4B's width: rows alone == batches; h' and x the residual's own bits."""
    from tensorfold_gemma4 import triton_ops

    n, d = 700, 2816
    h, a = randn(n, d, seed=24, scale=2.0), randn(n, d, seed=25, scale=2.0)
    wa, wn, pre = (1 + randn(d, seed=s, scale=0.1).float() for s in (26, 27, 28))
    kw = dict(
        wa=wa, wnext=wn, router_scale=1 + randn(d, seed=29, scale=0.1), const=d**-0.5, pre_norm=pre
    )
    assert_rows_invariant(lambda h, a: triton_ops.residual_router(h, a, 1e-6, **kw), h, a)
    got = triton_ops.residual_router(h, a, 1e-6, **kw)
    plain = triton_ops.residual(h, a, 1e-6, wa=wa, wnext=wn)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_fp8_row_writes_give_the_cpu_references_bits():
    """triton_kv_quant on the device (IEEE divisions, its own e4m3 rounding) against
    quantize_rows + index_copy_rows on the CPU (torch's CUDA path divides by 448 as a multiply
    by its reciprocal, so the CPU's is the reference): K and V of varied magnitudes, zero rows,
    and rows of scale 1 that hold every e4m3 value and every rounding tie."""
    from tensorfold.ops.kv_quant import FP8_DTYPE, index_copy_rows, quantize_rows
    from tensorfold.ops.triton_kv_quant import quantize_scatter

    g = torch.Generator().manual_seed(17)
    k = torch.randn(300, 8, 128, generator=g) * torch.logspace(-10, 5, 300)[:, None, None]
    k[5] = 0.0
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    ties = torch.cat([grid, mid, mid.nextafter(grid[1:]), mid.nextafter(grid[:-1])])
    ties = torch.cat([ties, -ties, torch.zeros((-2 * ties.numel()) % 255)]).view(-1, 1, 255)
    ties = torch.cat([torch.full((ties.shape[0], 1, 1), 448.0), ties], dim=-1)
    v = torch.zeros(300, 2, 256)
    v[: ties.shape[0]] = torch.cat([ties, ties * 0.5], dim=1)
    v[ties.shape[0] :] = torch.randn(300 - ties.shape[0], 2, 256, generator=g)
    for dtype in (torch.float32, BF16):
        index = torch.randperm(1200, generator=g)[:600:2]
        want, got = [], []
        for x in (k.to(dtype), v.to(dtype)):
            q, s = quantize_rows(x)
            dst = torch.zeros(1200, *x.shape[1:], dtype=FP8_DTYPE)
            sc = torch.zeros(1200, x.shape[1], 1)
            index_copy_rows(dst, index, q)
            sc.index_copy_(0, index, s)
            want.append((dst, sc))
            got.append(
                (
                    x.to(DEV),
                    torch.zeros(dst.shape, dtype=torch.uint8, device=DEV).view(FP8_DTYPE),
                    torch.zeros_like(sc, device=DEV),
                )
            )
        quantize_scatter(index.to(DEV), got)
        for (wq, ws), (_, gq, gs) in zip(want, got):
            assert torch.equal(gq.cpu().view(torch.uint8), wq.view(torch.uint8))
            assert torch.equal(gs.cpu().view(torch.int32), ws.view(torch.int32))


@pytest.mark.parametrize(
    "hq, hkv, d, fp8",
    [(16, 2, 512, False), (16, 2, 512, True), (32, 8, 64, False), (32, 8, 64, True)],
)
def test_attention_key_segments_walked_or_shared_give_the_same_bits(hq, hkv, d, fp8):
    """Paged attention over long contexts (gemma4's wide global heads, lfm2's GQA), with and
    without a window: one program walking each row's key segments, programs sharing them, and
    each stream alone (split its own way) all give the same bits; close to the torch path."""
    from tensorfold.family.forward_pass import ForwardPass, StreamRows
    from tensorfold.ops import attention as ref_attention
    from tensorfold.ops import triton_attention
    from tensorfold.ops.kv_quant import quantize_rows
    from tensorfold.ops.pass_meta import build_meta

    page_rows, pages = 64, 400
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(1)).tolist()
    specs = [(0, 9000, 1), (1, 3000, 40), (2, 0, 300), (3, 5000, 1)]  # slot, start, rows
    streams, used = [], 0
    for slot, start, n in specs:
        k = -(-(start + n) // page_rows)
        streams.append(StreamRows(slot, start, [0] * n, order[used : used + k], "all"))
        used += k
    fp = ForwardPass(streams, page_rows, DEV)
    k, v = randn(pages * page_rows, hkv, d, seed=2), randn(pages * page_rows, hkv, d, seed=3)
    scales = {}
    if fp8:
        (k, ks), (v, vs) = quantize_rows(k), quantize_rows(v)
        scales = {"k_scales": ks, "v_scales": vs}
    q = randn(fp.num_rows, hq, d, seed=4)

    def run(fp, q, window, parts):
        return triton_attention.paged_attention(
            q,
            k,
            v,
            fp.positions,
            build_meta(fp),
            page_rows,
            scale=d**-0.5,
            window=window,
            parts=parts,
            **scales,
        )

    for window in (None, 1024):
        walked = run(fp, q, window, 1)
        for parts in (7, None):
            assert torch.equal(run(fp, q, window, parts), walked), (window, parts)
        for i, st in enumerate(streams):
            a, z = fp.spans[i]
            alone = run(ForwardPass([st], page_rows, DEV), q[a:z].clone(), window, None)
            assert torch.equal(alone, walked[a:z]), (window, i)
        cpu = {n: t.cpu() for n, t in scales.items()}
        want = ref_attention.paged_attention(
            q.cpu(),
            k.cpu(),
            v.cpu(),
            ForwardPass(streams, page_rows),
            scale=d**-0.5,
            window=window,
            **cpu,
        )
        err = (walked.float().cpu() - want.float()).abs().max() / want.float().abs().max()
        assert err < 2e-2, (window, float(err))


def test_split_attention_compiles_once_for_any_table_width_and_rows():
    """A few rows after a long prefix split their keys (triton_key_split); the workspace's
    segment count follows the pass's table width, and the pass's layout views sit at offsets
    that follow its row count: neither may make Triton compile again (a chat's next turn once
    waited ~1 s for it; docs/journal/sessions.md, session 10)."""
    from triton import knobs

    from tensorfold.family.forward_pass import ForwardPass, StreamRows
    from tensorfold.ops import triton_attention
    from tensorfold.ops.pass_meta import build_meta

    page_rows, pages, hq, hkv, d = 64, 200, 8, 2, 64
    k, v = randn(pages * page_rows, hkv, d, seed=2), randn(pages * page_rows, hkv, d, seed=3)
    compiled: list[str] = []
    before = knobs.runtime.jit_cache_hook

    def hook(*, repr: str, **kw):
        compiled.append(repr.split("[", 1)[0])
        return before(repr=repr, **kw) if before else None

    knobs.runtime.jit_cache_hook = hook
    try:
        # 11 .. 194 pages, and row counts that put pass_meta's sections at other offsets
        for i, (start, n) in enumerate(((700, 3), (3000, 3), (5100, 33), (9001, 7), (12345, 20))):
            fp = ForwardPass(
                [StreamRows(0, start, [0] * n, list(range(-(-(start + n) // page_rows))))],
                page_rows,
                DEV,
            )
            q = randn(fp.num_rows, hq, d, seed=4)
            if i == 1:
                compiled.clear()  # the first width compiled what any width needs
            triton_attention.paged_attention(
                q, k, v, fp.positions, build_meta(fp), page_rows, scale=d**-0.5, parts=4
            )
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = before
    assert compiled == [], compiled


# -- each family's model through its kernels, on its demo checkpoint ------------------------------


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    package = FAMILIES[request.param]
    folder: Path = importlib.import_module(f"{package}.demo").build_demo(
        tmp_path_factory.mktemp(request.param)
    )
    load = importlib.import_module(f"{package}.model").load
    return load(Checkpoint.open(folder), DEV, "bfloat16")


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, min(vocab, 700), (n,), generator=g).tolist() for n in (300, 2200, 900)]


def make_runner(
    model, *, num_pages: int = 16, num_slots: int = 3, page_rows: int = 512, poison: bool = False
) -> ModelRunner:
    return ModelRunner(
        model, num_pages=num_pages, num_slots=num_slots, page_rows=page_rows, poison=poison
    )


def bound(model):
    return lambda model=model, **kw: make_runner(model, **kw)


@pytest.mark.parametrize("together", [(0, 1), (0, 2), (1, 2), (0, 1, 2)])
def test_streams_in_one_pass_equal_streams_alone(model, together):
    testing.assert_streams_together_equal_alone(
        bound(model), model, prompts(model.vocab_size), together, num_pages=24, max_rows=3000
    )


def test_shuffled_pages_and_poisoned_free_pages_change_nothing(model):
    tokens = prompts(model.vocab_size)[1][:600]
    cuts = [0, 64, 320, 599, 600]
    testing.assert_shuffled_pages_change_nothing(model, tokens, cuts)
    testing.assert_poisoned_pages_change_nothing(bound(model), prompts(model.vocab_size)[0])


def test_graph_runner_decode_rounds_equal_plain_passes(model):
    from tensorfold.engine.cuda_graphs import GraphRunner

    def rounds(runner) -> list[torch.Tensor]:
        streams = [open_stream(runner, i, 512) for i in range(3)]
        out = runner.run(
            [
                s.rows(p[: 100 + 60 * i])
                for i, (s, p) in enumerate(zip(streams, prompts(model.vocab_size)))
            ]
        )
        logits = [torch.cat(out)]
        for _ in range(4):
            out = runner.run([s.rows([int(o[-1].argmax())]) for s, o in zip(streams, out)])
            logits.append(torch.cat(out))
        return logits

    plain = rounds(make_runner(model, num_pages=8, num_slots=3))
    graphs = GraphRunner(model, num_pages=8, num_slots=4, page_rows=512, max_pages=2)
    graphed = rounds(graphs)
    assert graphs.replays == 4
    for g, p in zip(graphed, plain):
        assert torch.equal(g, p)


@pytest.mark.parametrize("v", [65536, 262144])
def test_sampler_rows_alone_equal_batches(v: int):
    """The sampler's row kernel: a row's greedy token, max and log-sum alone as in any batch;
    the token torch's argmax, the logprob log_softmax's within rounding."""
    from tensorfold.ops.triton_row_stats import row_stats

    x = randn(64, v, seed=v, scale=4.0)
    x[3, 17] = x[3, 900] = x[3].max() + 1  # a tie: the lower id
    tok, both, top, log_sum = full = row_stats(x)
    for m in (1, 2, 7, 33):
        for start in (0, 64 - m):
            part = row_stats(x[start : start + m].clone())
            for p, f in zip(part, full):
                assert torch.equal(p, f[start : start + m]), f"rows {start}:{start + m}"
    xf = x.float()
    assert torch.equal(tok, xf.argmax(1)) and int(tok[3]) == 17
    lsm = torch.log_softmax(xf, 1)
    assert torch.allclose(both[:, 1], lsm.gather(1, tok[:, None])[:, 0].double(), atol=1e-5)
    assert torch.allclose((xf - top[:, None]) - log_sum[:, None], lsm, atol=1e-5)
