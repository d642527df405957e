"""Each Triton kernel against its torch reference (core/ops), on the CPU under TRITON_INTERPRET=1
at small sizes, and its batch invariance: a row's bits never depend on the other rows."""

from __future__ import annotations

import os
from collections.abc import Callable

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import attention as ref_attention  # noqa: E402
from tensorfold.ops import conv as ref_conv  # noqa: E402
from tensorfold.ops import linear as ref_linear  # noqa: E402
from tensorfold.ops import moe as ref_moe  # noqa: E402
from tensorfold.ops import norms as ref_norms  # noqa: E402
from tensorfold.ops import rope as ref_rope  # noqa: E402
from tensorfold.ops import (  # noqa: E402
    switches,  # noqa: E402
    triton_align,
    triton_attention,
    triton_conv,
    triton_linear,
    triton_moe,
    triton_norms,
    triton_rope,
    triton_route,
    triton_util,
)
from tensorfold.ops.kv_quant import dequantize_rows, quantize_rows  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _round_to_nearest_even(request: pytest.FixtureRequest):
    """The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does):
    give it the GPU's rounding, so bf16 results compare bit for bit with the references."""
    with testing.interpreter_rounds_like_the_gpu():
        yield


DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def randn(*shape: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


# --- linear ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference_and_is_row_invariant(dtype, tol, bias):
    x = randn(70, 96, seed=0, dtype=dtype)
    w = randn(80, 96, seed=1, dtype=dtype, scale=0.1)
    b = randn(80, seed=2, dtype=dtype) if bias else None
    got = triton_linear.linear(x, w, b)
    assert got.dtype == dtype and got.shape == (70, 80)
    assert (
        rel(got, ref_linear.linear(x.double(), w.double(), None if b is None else b.double())) < tol
    )
    for a, z in [(0, 1), (3, 4), (5, 22), (40, 70), (69, 70)]:
        assert torch.equal(triton_linear.linear(x[a:z].clone(), w, b), got[a:z])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 70])  # the split grid's tile, a prompt's
def test_linear_stored_as_fp32_is_the_rounded_product_widened(bias, rows):
    """out_dtype=fp32 (the logits): the bf16 product's bits, widened by the product's own store,
    on the kernels and on the CPU path."""
    x = randn(rows, 96, seed=6, dtype=torch.bfloat16)
    w = randn(80, 96, seed=7, dtype=torch.bfloat16, scale=0.1)
    b = randn(80, seed=8, dtype=torch.bfloat16) if bias else None
    got = triton_linear.linear(x, w, b, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, triton_linear.linear(x, w, b).float())
    cpu = ref_linear.linear(x, w, b, out_dtype=torch.float32)
    assert cpu.dtype == torch.float32 and torch.equal(cpu, ref_linear.linear(x, w, b).float())


@pytest.mark.parametrize("n, k, rows", [(256, 128, 70), (512, 64, 300)])
@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_linear_groups_in_one_launch_match_each_groups_product_and_are_row_invariant(
    n, k, rows, dtype, tol
):
    """Two products of adjacent column groups of one pass (x a column slice of a wider pass)
    in one launch, stacked: each the reference's product of its group; a row alone == in the
    pass on every tile (the split grid's, a prompt's, a long prompt's 128-wide)."""
    wide = randn(rows, 2 * k + 40, seed=3, dtype=dtype)
    x = wide[:, : 2 * k]
    w = randn(2 * n, k, seed=4, dtype=dtype, scale=0.1)
    assert triton_linear.groups_fit(2 * n, k, 2)
    got = triton_linear.linear_groups(x, w, 2)
    assert got.shape == (2, rows, n) and got.dtype == dtype
    for g in range(2):
        part = x[:, g * k : (g + 1) * k].double()
        assert rel(got[g], ref_linear.linear(part, w[g * n : (g + 1) * n].double())) < tol
    for a, z in [(0, 1), (3, 4), (5, 22), (40, 70), (rows - 1, rows)]:
        assert torch.equal(triton_linear.linear_groups(x[a:z].clone(), w, 2), got[:, a:z])
    cpu = ref_linear.linear_groups(x, w, 2)  # the CPU path: a product a group
    assert cpu.shape == got.shape and rel(cpu, got) < tol


def test_linear_groups_name_what_they_take():
    x, w = torch.zeros(3, 100), torch.zeros(512, 64)
    with pytest.raises(ValueError, match=r"do not make 2 groups \(x \[M, 2·K\]"):
        ref_linear.linear_groups(x, w, 2)
    assert not triton_linear.groups_fit(2 * 96, 64, 2)  # 96 rows a group: no 128-wide tile
    with pytest.raises(ValueError, match="rows a group a multiple of 128"):
        triton_linear.linear_groups(torch.zeros(3, 128), torch.zeros(192, 64), 2)


# --- norms ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rms_norm_and_the_residual_add(dtype, tol):
    x = randn(37, 3, 64, seed=3, dtype=dtype)
    r = randn(37, 3, 64, seed=4, dtype=dtype)
    w = (1 + randn(64, seed=5) * 0.1).to(dtype)
    got = triton_norms.rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel(got, ref_norms.rms_norm(x, w, 1e-5)) < tol / 10
    normed, h = triton_norms.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(h, x + r)
    assert rel(normed, ref_norms.rms_norm(x + r, w, 1e-5)) < tol / 10
    assert torch.equal(triton_norms.rms_norm(x[5:6].clone(), w, 1e-5), got[5:6])


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rms_norm_with_an_fp32_weight_rounds_once(dtype, tol):
    """fp32_weight: w · x̂ in fp32, rounded once to x's dtype (Olmo2RMSNorm), as the torch
    reference; a row alone gives its bits among others."""
    x = randn(37, 3, 72, seed=3, dtype=dtype)
    w = (1 + randn(72, seed=5) * 0.1).to(dtype)
    got = triton_norms.rms_norm(x, w, 1e-5, fp32_weight=True)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel(got, ref_norms.rms_norm(x, w, 1e-5, fp32_weight=True)) < tol / 10
    assert torch.equal(triton_norms.rms_norm(x[5:6].clone(), w, 1e-5, fp32_weight=True), got[5:6])


@pytest.mark.parametrize("k", [1, 4])
def test_add_rms_norm_sums_a_moes_slots_as_the_slot_sum_does(k, kernels_on_cpu):
    """The next add_rms_norm sums a MoE's slots (moe.SlotSum) in its own launch: the bits of the
    slot sum's kernel then the norm, and of the CPU path's sum; a row alone as among others."""
    slots = randn(9, k, 300, seed=6, dtype=torch.bfloat16)
    r = randn(9, 300, seed=7, dtype=torch.bfloat16)
    w = (1 + randn(300, seed=8) * 0.1).to(torch.bfloat16)
    want = ref_norms.add_rms_norm(triton_moe.slot_sum(slots), r, w, 1e-5)
    got = ref_norms.add_rms_norm(ref_moe.SlotSum(slots), r, w, 1e-5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(ref_moe.SlotSum(slots).total(), triton_moe.slot_sum(slots))
    alone = ref_norms.add_rms_norm(ref_moe.SlotSum(slots[4:5].clone()), r[4:5].clone(), w, 1e-5)
    assert torch.equal(alone[0], got[0][4:5]) and torch.equal(alone[1], got[1][4:5])
    from tensorfold.ops import gpu

    gpu.set_triton(False)
    cpu = ref_norms.add_rms_norm(ref_moe.SlotSum(slots), r, w, 1e-5)
    assert torch.equal(cpu[1], got[1])  # the sum and the residual add: exact either way


# --- rope ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_rope_matches_reference(dtype, tol):
    pos = torch.tensor([0, 1, 7, 511, 512, 4095, 20000])
    x = randn(len(pos), 5, 64, seed=6, dtype=dtype)
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(64, 1e6), dtype)
    got = triton_rope.apply_rope(x, cos, sin)
    want = ref_rope.apply_rope(x, cos, sin)
    assert rel(got, want) < 1e-6
    assert torch.equal(triton_rope.apply_rope(x[2:3].clone(), cos[2:3], sin[2:3]), got[2:3])


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("fp32_weight", [False, True])
def test_norm_rope_in_one_launch_matches_the_norm_then_rope(dtype, tol, fp32_weight):
    """Each head normalised then rotated in one launch (lfm2's w · round(x̂), gemma4's x̂·w in
    fp32): the CPU path's norm then rope, within rounding; a row alone as among others."""
    pos = torch.tensor([0, 1, 7, 511, 512, 4095, 20000])
    x = randn(len(pos), 5, 64, seed=6, dtype=dtype) * 3
    w = 1 + randn(64, seed=9) * 0.1
    w = w if fp32_weight else w.to(dtype)
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(64, 1e6), dtype)
    got = triton_rope.norm_rope(x, w, 1e-6, cos, sin, fp32_weight)
    if fp32_weight:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(dtype)
    else:
        normed = ref_norms.rms_norm(x, w, 1e-6)
    want = ref_rope.apply_rope(normed, cos, sin)
    assert got.dtype == dtype and rel(got, want) < tol / 10
    alone = triton_rope.norm_rope(x[2:3].clone(), w, 1e-6, cos[2:3], sin[2:3], fp32_weight)
    assert torch.equal(alone, got[2:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv", [(6, 3), (4, 4)])
def test_qkv_norm_rope_write_in_one_launch_matches_the_launches_it_replaces(dtype, hq, hkv):
    """q and k normalised and rotated, k and v stored at scattered rows of larger buffers, in one
    launch: the bits of norm_rope's launch for q and for k and the two index copies; the
    buffers' other rows untouched; a row alone as among others."""
    pos = torch.tensor([0, 1, 7, 511, 512, 4095, 20000])
    n, d = len(pos), 64
    qkv = randn(n, hq + 2 * hkv, d, seed=10, dtype=dtype) * 3
    q_norm, k_norm = ((1 + randn(d, seed=s) * 0.1).to(dtype) for s in (11, 12))
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(d, 1e6), dtype)
    index = torch.randperm(40, generator=gen(13))[:n]
    k_rows, v_rows = (randn(40, hkv, d, seed=s, dtype=dtype) for s in (14, 15))
    k_want, v_want = k_rows.clone(), v_rows.clone()
    q, k, v = qkv.split((hq, hkv, hkv), dim=1)
    q_want = triton_rope.norm_rope(q, q_norm, 1e-6, cos, sin, False)
    k_want.index_copy_(0, index, triton_rope.norm_rope(k, k_norm, 1e-6, cos, sin, False))
    v_want.index_copy_(0, index, v)
    got = triton_rope.qkv_norm_rope_write(
        qkv, q_norm, k_norm, 1e-6, cos, sin, k_rows, v_rows, index
    )
    assert torch.equal(got, q_want)
    assert torch.equal(k_rows, k_want) and torch.equal(v_rows, v_want)
    k_alone, v_alone = torch.zeros_like(k_rows), torch.zeros_like(v_rows)
    alone = triton_rope.qkv_norm_rope_write(
        qkv[2:3].clone(), q_norm, k_norm, 1e-6, cos[2:3], sin[2:3], k_alone, v_alone, index[2:3]
    )
    assert torch.equal(alone, got[2:3])
    assert torch.equal(k_alone[index[2]], k_rows[index[2]])
    assert torch.equal(v_alone[index[2]], v_rows[index[2]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, k_eq_v", [(6, 3, False), (4, 2, True)])
def test_qkv_heads_in_one_launch_match_the_launches_they_replace(dtype, hq, hkv, k_eq_v):
    """gemma4's q, k and v heads from one product in one launch: q and k the bits of norm_rope's
    launch (x̂·w in fp32), v each head's x̂ rounded once (the CPU path's Gemma4RMSNorm without
    a weight, within rounding); under k_eq_v V from the raw k heads; a row alone as among
    others."""
    pos = torch.tensor([0, 1, 7, 511, 512, 4095, 20000])
    n, d = len(pos), 64
    heads = randn(n, hq + hkv * (1 if k_eq_v else 2), d, seed=16, dtype=dtype) * 3
    q_norm, k_norm = (1 + randn(d, seed=s) * 0.1 for s in (17, 18))
    cos, sin = ref_rope.cos_sin(pos, ref_rope.inv_freq(d, 1e6), dtype)
    v_first = hq if k_eq_v else hq + hkv
    q, k, v = triton_rope.qkv_heads(heads, hq, hkv, v_first, q_norm, k_norm, 1e-6, cos, sin)
    assert torch.equal(q, triton_rope.norm_rope(heads[:, :hq], q_norm, 1e-6, cos, sin, True))
    assert torch.equal(
        k, triton_rope.norm_rope(heads[:, hq : hq + hkv], k_norm, 1e-6, cos, sin, True)
    )
    vf = heads[:, v_first : v_first + hkv].float()
    v_want = (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert v.dtype == dtype and v.shape == (n, hkv, d) and rel(v, v_want) < tol
    alone = triton_rope.qkv_heads(
        heads[2:3].clone(), hq, hkv, v_first, q_norm, k_norm, 1e-6, cos[2:3], sin[2:3]
    )
    assert all(torch.equal(a, b[2:3]) for a, b in zip(alone, (q, k, v)))


# --- a pass over several streams ---


def _pass(specs, page_rows=8, vocab=50):
    """specs: (slot, start, rows, pages) per stream -> ForwardPass."""
    g = gen(11)
    streams = [
        StreamRows(slot, start, torch.randint(0, vocab, (n,), generator=g).tolist(), pages, "all")
        for slot, start, n, pages in specs
    ]
    return ForwardPass(streams, page_rows)


# slot, start, rows, pages: a fresh prompt, a decode row, a chunk from row 21, a 1-row prompt
MIXED = [
    (2, 0, 19, [7, 3, 9]),
    (0, 33, 1, [1, 5, 0, 4, 6]),
    (1, 21, 30, [10, 12, 2, 11, 8, 13, 14]),
    (3, 0, 1, [15]),
]


# --- short conv ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gated_conv_over_a_pass_matches_the_per_stream_reference(dtype, tol, with_bias):
    h, k = 40, 3
    fp = _pass(MIXED)
    n = fp.num_rows
    bcx = randn(n, 3 * h, seed=12, dtype=dtype)
    state = randn(4, h, k - 1, seed=13, dtype=dtype)
    w = randn(h, k, seed=14, dtype=dtype, scale=0.5)
    b = randn(h, seed=15, dtype=dtype) if with_bias else None
    ref_state = state.clone()
    want = ref_conv.gated_conv(bcx, ref_state, fp, w, b)
    got_state = state.clone()
    got = triton_conv.gated_conv(bcx, got_state, build_meta(fp), w, b)
    assert rel(got, want) < tol
    assert torch.equal(got_state, ref_state)  # tails are copies of B⊙x: exact
    # stream 2 (a chunk) alone gives the same bits as beside the others
    alone = ForwardPass([fp.streams[2]], 8)
    a, z = fp.spans[2]
    st = state.clone()
    out = triton_conv.gated_conv(bcx[a:z].clone(), st, build_meta(alone), w, b)
    assert torch.equal(out, got[a:z])


@pytest.mark.parametrize("k", [2, 3, 4])
def test_decode_round_conv_moves_tails_in_its_own_launch(k):
    """A pass of one row a stream (a decode round; one stream fresh, one past its first row, one
    deep): the conv moves each tail on in its own launch, to the bits the second launch (a
    prompt pass's way) gives."""
    h = 200  # two channel blocks, the second part masked
    fp = _pass([(3, 0, 1, [0]), (0, 1, 1, [1]), (5, 20, 1, [2, 4, 6])])
    bcx = randn(3, 3 * h, seed=16, dtype=torch.bfloat16)
    state = randn(6, h, k - 1, seed=17, dtype=torch.bfloat16)
    w = randn(h, k, seed=18, dtype=torch.bfloat16, scale=0.5)
    b = randn(h, seed=19, dtype=torch.bfloat16)
    ref_state = state.clone()
    want = ref_conv.gated_conv(bcx, ref_state, fp, w, b)  # the CPU path
    got_state = state.clone()
    got = triton_conv.gated_conv(bcx, got_state, build_meta(fp), w, b, one_row_each=True)
    two_state = state.clone()
    two = triton_conv.gated_conv(bcx, two_state, build_meta(fp), w, b)
    assert torch.equal(got, two) and torch.equal(got_state, two_state)
    assert torch.equal(got_state, ref_state) and rel(got, want) < 2e-2
    assert torch.equal(got_state[[1, 2, 4]], state[[1, 2, 4]])  # slots of no stream: untouched


# --- attention ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_matches_reference_and_a_stream_alone(dtype, tol, window):
    page_rows, hkv, group, d = 8, 2, 3, 16
    fp = _pass(MIXED, page_rows)
    k = randn(16 * page_rows, hkv, d, seed=16, dtype=dtype)
    v = randn(16 * page_rows, hkv, d, seed=17, dtype=dtype)
    q = randn(fp.num_rows, hkv * group, d, seed=18, dtype=dtype)
    _poison_unwritten(fp, page_rows, k, v)  # rows a stream has not written: never read
    want = ref_attention.paged_attention(q, k, v, fp, scale=0.25, window=window)
    got = triton_attention.paged_attention(
        q, k, v, fp.positions, build_meta(fp), page_rows, scale=0.25, window=window
    )
    assert not got.isnan().any()
    assert rel(got, want) < tol
    _assert_streams_alone_equal(fp, page_rows, q, k, v, got, window=window)


def _poison_unwritten(fp: ForwardPass, page_rows: int, *rows: torch.Tensor) -> None:
    """NaN into every flat row no stream of `fp` has written (rows, and fp8 rows' scales)."""
    written = torch.zeros(rows[0].shape[0], dtype=torch.bool)
    for s in fp.streams:
        for pos in range(s.end):
            written[s.pages[pos // page_rows] * page_rows + pos % page_rows] = True
    for t in rows:
        t[(~written).nonzero().flatten()] = float("nan")  # no boolean masks for e4m3


def _assert_streams_alone_equal(
    fp: ForwardPass,
    page_rows: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    got: torch.Tensor,
    **kw,
) -> None:
    """Each stream of `fp` alone through the Triton kernel gives its rows of `got`, bit for bit."""
    for i in range(len(fp.streams)):
        alone = ForwardPass([fp.streams[i]], page_rows)
        a, z = fp.spans[i]
        out = triton_attention.paged_attention(
            q[a:z].clone(), k, v, alone.positions, build_meta(alone), page_rows, scale=0.25, **kw
        )
        assert torch.equal(out, got[a:z]), f"stream {i}"


@pytest.mark.parametrize("dtype, tol", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_paged_attention_over_fp8_rows_matches_reference_and_a_stream_alone(dtype, tol, window):
    """TF_KV_DTYPE=fp8: e4m3 rows with their scales, poisoned where unwritten (rows and scales)."""
    page_rows, hkv, group, d = 8, 2, 3, 16
    fp = _pass(MIXED, page_rows)
    k, ks = quantize_rows(randn(16 * page_rows, hkv, d, seed=26, scale=3.0))
    v, vs = quantize_rows(randn(16 * page_rows, hkv, d, seed=27, scale=0.1))
    q = randn(fp.num_rows, hkv * group, d, seed=28, dtype=dtype)
    _poison_unwritten(fp, page_rows, k, ks, v, vs)
    scales = {"k_scales": ks, "v_scales": vs}
    want = ref_attention.paged_attention(q, k, v, fp, scale=0.25, window=window, **scales)
    # the reference over the same rows dequantized up front: the scales are folded in right
    plain = ref_attention.paged_attention(
        q, dequantize_rows(k, ks), dequantize_rows(v, vs), fp, scale=0.25, window=window
    )
    assert rel(want, plain) < (1e-6 if dtype == torch.float32 else 1e-2)
    got = triton_attention.paged_attention(
        q, k, v, fp.positions, build_meta(fp), page_rows, scale=0.25, window=window, **scales
    )
    assert not got.isnan().any()
    assert rel(got, want) < tol
    _assert_streams_alone_equal(fp, page_rows, q, k, v, got, window=window, **scales)


def test_bf16_queries_meet_fp8_rows_as_fp16_clamped_to_its_range():
    """A bf16 q meets e4m3 rows as fp16 (triton_attention.scaled_q): a q past fp16's largest
    finite value is clamped there, never an inf that would turn the row's scores into NaN."""
    page_rows, hkv, group, d = 8, 2, 3, 16
    fp = _pass(MIXED, page_rows)
    k, ks = quantize_rows(randn(16 * page_rows, hkv, d, seed=26, scale=3.0))
    v, vs = quantize_rows(randn(16 * page_rows, hkv, d, seed=27, scale=0.1))
    q = randn(fp.num_rows, hkv * group, d, seed=28, dtype=torch.bfloat16) * 1e-3
    q[0, 0, :4] = torch.tensor([1e6, -1e6, 7e4, 3.0])  # past fp16's 65504, and one inside
    scales = {"k_scales": ks, "v_scales": vs}
    got = triton_attention.paged_attention(
        q, k, v, fp.positions, build_meta(fp), page_rows, scale=0.25, **scales
    )
    want = ref_attention.paged_attention(
        q.float().clamp(-65504, 65504), k, v, fp, scale=0.25, **scales
    )
    assert got.isfinite().all()
    assert rel(got, want) < 2e-2


def test_attention_tiles_follow_the_shape_and_the_rows_dtype_only():
    """A program's tile is a function of (D, Dv, group, fp8 rows), never of the pass: lfm2's
    narrow GQA heads take 16 queries x 4 heads in bf16 and 4 x 4 in fp8; gemma4's wide heads
    one block of all their output columns (512 global, 256 sliding) at 8 warps."""
    assert triton_attention.tiles(64, 64, 4) == (16, 64, 64)
    assert triton_attention.tiles(64, 64, 4, fp8=True) == (4, 64, 64)
    for fp8 in (False, True):
        assert triton_attention.tiles(512, 512, 8, fp8) == (2, 64, 512)
        assert triton_attention.tiles(256, 256, 2, fp8) == (8, 64, 256)
    assert (triton_attention.warps(64, 64), triton_attention.warps(512, 512)) == (4, 8)


# --- MoE ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm, bias", [(True, True), (False, False)])
def test_route_matches_reference(dtype, norm, bias):
    x = randn(45, 600, seed=19, dtype=dtype)  # 3 splits of the router's columns
    gate = randn(12, 600, seed=20, dtype=dtype, scale=0.05)
    eb = randn(12, seed=21, scale=0.1) if bias else None
    want_w, want_e = ref_moe.route(x, gate, eb, 3, norm_topk_prob=norm, scaling=2.5)
    got_w, got_e = triton_route.route(x, gate, eb, 3, norm_topk_prob=norm, scaling=2.5)
    assert got_e.dtype == torch.long and got_w.dtype == dtype
    # The logits are summed in another order (and exp may differ by an ulp): where two experts'
    # keys are within rounding of each other, either may be chosen. Elsewhere, the same.
    key = ref_moe.sigmoid(ref_linear.linear(x, gate)).float() + (0 if eb is None else eb)
    assert (key.gather(1, got_e) - key.gather(1, want_e)).abs().max() <= 2**-7
    same = (got_e == want_e).all(-1)
    assert same.float().mean() > 0.8
    tol = 1e-6 if dtype == torch.float32 else 4e-3
    assert rel(got_w[same], want_w[same]) < tol
    for a, z in [(0, 1), (20, 21), (3, 30)]:
        sw, se = triton_route.route(x[a:z].clone(), gate, eb, 3, norm_topk_prob=norm, scaling=2.5)
        assert torch.equal(se, got_e[a:z]) and torch.equal(sw, got_w[a:z])


def _grouped_route(x, gate, bias, topk):
    """An fp32 router as GLM's: 8 groups of which 4 kept, the top k normalised and scaled by
    2.5, the pairs aligned by expert."""
    return triton_route.route(
        x,
        gate,
        bias,
        topk,
        norm_topk_prob=True,
        scaling=2.5,
        fp32=True,
        norm_eps=1e-20,
        groups=8,
        keep_groups=4,
        by_expert=True,
    )


@pytest.mark.parametrize("sums", [True, False])
def test_fp32_router_on_a_columns_major_gate_chains_its_fmas_a_row_alone_as_in_a_batch(sums):
    """An fp32 router with expert groups (glm5_next's kind), its gate stored transposed
    (columns_major), so each logit is one FMA chain a chunk of H (_router_chain_kernel; a pass
    of up to FP32_CHAIN_SPLIT_ROWS rows a program a chunk, the chunks added by the last to
    arrive, or with sums off by the route kernel; a larger pass's programs walk the chunks):
    the logits of x.float() @ gate.float()ᵀ within fp32 rounding, the experts and weights of
    the row-major gate's kernel where no two keys are within rounding, and a row alone (a
    one-row tile) the bits of the same row in a split pass and in a walked one."""
    with switches.switched(switches.FP32_CHAIN_SUMS, sums):
        x = randn(45, 600, seed=23, dtype=torch.bfloat16)  # 10 chunks of 64, the last one short
        gate = randn(64, 600, seed=24, scale=0.05)
        bias = randn(64, seed=25, scale=0.1)
        cols = triton_route.columns_major(gate)
        assert triton_route.is_columns_major(cols) and torch.equal(cols, gate)
        assert triton_route.columns_major(cols) is cols

        def run(rows, g):
            return _grouped_route(rows, g, bias, 6)

        logits = x.float() @ gate.t()
        for rows in (x[:1], x[:16], x):  # one row, a split pass, a walked one
            part, splits = triton_route._chain_logits(rows, cols, 64)
            assert splits == (1 if sums or rows.shape[0] > 16 else 10)
            got = part.sum(0) if splits > 1 else part[0]
            want = logits[: rows.shape[0]]
            assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        got_w, got_e = run(x, cols)
        want_w, want_e = run(x, gate)  # the row-major gate: the tiled kernel's sums
        same = (got_e == want_e).all(-1)
        assert same.float().mean() > 0.9
        assert rel(got_w[same], want_w[same]) < 1e-6
        for a, z in [(0, 1), (20, 21), (44, 45), (3, 19), (3, 30)]:
            sw, se = run(x[a:z].clone(), cols)
            assert torch.equal(se, got_e[a:z]) and torch.equal(sw, got_w[a:z])


@pytest.mark.parametrize("rows", [37, 300])  # one program; a program per chunk of pairs
def test_align_sorts_pairs_by_expert_in_padded_blocks(rows):
    experts = torch.randint(0, 6, (rows, 3), generator=gen(22))
    al = triton_align.align(experts, 6, triton_moe.BLOCK_M)
    flat = experts.reshape(-1)
    bm = triton_moe.BLOCK_M
    seen = []
    for b in range(al.max_blocks):
        e = int(al.block_expert[b])
        rows = al.sorted_pairs[b * bm : (b + 1) * bm]
        if e == 6:
            continue
        real = rows[rows < flat.numel()]
        assert (flat[real.long()] == e).all()
        seen += real.tolist()
    assert sorted(seen) == list(range(flat.numel()))
    # stable: within an expert, pairs in order
    assert seen == sorted(seen, key=lambda p: (int(flat[p]), p))


def _router(softmax: bool, e: int, k: int, seed: int):
    """A bf16 router of e experts over 96 wide rows: gemma4's softmax with per-expert scales,
    or the sigmoid route; rows [N, 96] -> (weights, experts)."""
    gate = randn(e, 96, seed=seed, scale=0.1).to(torch.bfloat16)
    scale = (1 + randn(e, seed=seed + 1, scale=0.1)).float()

    def run(rows):
        if softmax:
            return triton_route.softmax_route(rows, gate, k, scale)
        return triton_route.route(rows, gate, None, k, norm_topk_prob=True, scaling=2.5)

    return run


@pytest.mark.parametrize("softmax, e, k", [(True, 128, 8), (False, 32, 4)])
def test_route_a_program_a_row_equals_the_rows_tiles(softmax, e, k):
    """A pass its router does not align, routed a program a row on the one-row tile, gives its
    rows the weights and experts of a pass of a few rows (ROUTE_ROWS rows a program, aligned
    by the route) and of a row alone."""
    x = randn(40, 96, seed=83, dtype=torch.bfloat16)
    run = _router(softmax, e, k, seed=84)
    got = run(x)
    rows = triton_route.route_rows(e)
    assert not triton_route.aligns_in_route(40, k, e, rows)
    for a, z in [(0, 1), (5, 7), (20, 36), (39, 40)]:
        want = run(x[a:z].clone())
        assert torch.equal(got[0][a:z], want[0]) and torch.equal(got[1][a:z], want[1])


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    """The launch code's host arithmetic (triton_util) gives Triton's integers."""
    import triton

    for a in [0, 1, 2, 3, 7, 8, 9, 31, 32, 33, 100, 1023, 1024, 1025, 65536, 262145]:
        assert triton_util.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in [1, 2, 3, 16, 64, 128, 256, 1000]:
            assert triton_util.cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.parametrize(
    "e, k, softmax, by_expert",
    [(6, 3, False, False), (32, 4, False, False), (128, 8, True, False), (288, 8, False, True)],
)
def test_router_of_a_few_rows_sorts_their_pairs_as_align_does(e, k, softmax, by_expert):
    """A pass of one row or a few (a decode round of a few streams): the router's program also
    aligns the pairs (one launch fewer a MoE layer), in the order and block map triton_align
    gives, which the MoE then takes; passes it does not hold whole (more rows than a route
    program's, or a one-hot past FEW_ROWS_ONE_HOT) leave it to align."""
    x, gate = randn(40, 64, seed=50), randn(e, 64, seed=51)
    rows = triton_route.route_rows(e)
    for n in (1, 2, 3, 8, 16, 17):
        if softmax:
            w, experts = triton_route.softmax_route(x[:n].clone(), gate, k, None)
        else:
            w, experts = triton_route.route(
                x[:n].clone(), gate, None, k, norm_topk_prob=True, scaling=1.0, by_expert=by_expert
            )
        got = triton_moe.prealigned(experts, e, triton_moe.TINY_BLOCK_M)
        if not triton_route.aligns_in_route(n, k, e, rows):
            assert got is None and n > 1
            continue
        assert n <= 16
        want = triton_align.align(experts, e, triton_moe.TINY_BLOCK_M)
        assert got is not None and got.max_blocks == want.max_blocks
        assert torch.equal(got.block_expert, want.block_expert)
        used = (want.block_expert < e).repeat_interleave(triton_moe.TINY_BLOCK_M)  # past: unread
        assert torch.equal(got.sorted_pairs[used], want.sorted_pairs[used])
        assert triton_moe.prealigned(experts, e + 1, triton_moe.TINY_BLOCK_M) is None
        assert triton_moe.prealigned(experts, e, triton_moe.SMALL_BLOCK_M) is None
    assert triton_route.aligns_in_route(8, 4, 32, 16)  # LFM2-8B-A1B at 8 streams
    assert not triton_route.aligns_in_route(17, 4, 32, 16)


@pytest.mark.parametrize("softmax, e, k", [(True, 128, 8), (False, 128, 8), (False, 32, 4)])
def test_route_of_one_row_on_its_own_tile_equals_the_rows_tile(softmax, e, k):
    """A one-row pass's route on a [1, E] tile (one warp; four in the one-launch router of 32
    experts) gives the weights and experts of the row in a larger pass (gemma4's 128 experts,
    top 8; lfm2's 32, top 4, whose 3 rows route on the [ROUTE_ROWS, E] tile), and sorts its
    pairs as triton_align does."""
    x = randn(3, 96, seed=80, dtype=torch.bfloat16)
    run = _router(softmax, e, k, seed=81)
    assert triton_route.fuses_one_row(1, e) == (e <= triton_route.FUSE_MAX_EXPERTS)
    got = run(x[1:2].clone())
    three = run(x)
    assert torch.equal(three[0][1:2], got[0]) and torch.equal(three[1][1:2], got[1])
    a, b = got[1].tf_aligned, triton_align.align(got[1], e, triton_moe.TINY_BLOCK_M)
    assert torch.equal(a.block_expert, b.block_expert)
    used = (b.block_expert < e).repeat_interleave(triton_moe.TINY_BLOCK_M)
    assert torch.equal(a.sorted_pairs[used], b.sorted_pairs[used])


@pytest.mark.parametrize("kind", ["sigmoid", "softmax", "fp32_groups"])
def test_router_of_one_row_in_one_launch_equals_its_two(kind):
    """A one-row pass's router runs its partials and its top k in one launch (the last program
    to finish its split routes): the weights and experts of the row in a two-row pass (two
    launches), and its pairs sorted as triton_align sorts them."""
    xs = randn(2, 600, seed=52, dtype=torch.bfloat16)
    gate = randn(64, 600, seed=53, scale=0.05)
    gate = gate.to(torch.bfloat16)
    bias, scale = randn(64, seed=54, scale=0.1), randn(64, seed=55).abs()

    def run(x):
        if kind == "softmax":
            return triton_route.softmax_route(x, gate, 8, scale.to(torch.bfloat16))
        if kind == "fp32_groups":
            return _grouped_route(x, gate, bias, 6)
        return triton_route.route(x, gate, bias, 4, norm_topk_prob=True, scaling=2.5)

    assert triton_route.fuses_one_row(1, gate.shape[0])
    got = [run(xs[:1].clone()) for _ in range(2)]  # the arrival counter is left at zero
    two = run(xs)
    for w, e in got:
        assert torch.equal(w, two[0][:1]) and torch.equal(e, two[1][:1])
        a, b = e.tf_aligned, triton_align.align(e, 64, triton_moe.TINY_BLOCK_M)
        assert torch.equal(a.block_expert, b.block_expert)
        used = (b.block_expert < 64).repeat_interleave(triton_moe.TINY_BLOCK_M)
        assert torch.equal(a.sorted_pairs[used], b.sorted_pairs[used])


def test_norm_and_router_of_one_row_in_one_launch_equal_their_own():
    """A one-row pass's add + RMSNorm runs in its router's launch (norm_route): h, x, the
    weights, experts and sorted pairs as add_rms_norm's launch then the router's; a pass of
    more rows launches them as they are."""
    y, r = (
        randn(1, 600, seed=56, dtype=torch.bfloat16),
        randn(1, 600, seed=57, dtype=torch.bfloat16),
    )
    nw = (1 + randn(600, seed=58, scale=0.1)).to(torch.bfloat16)
    gate = randn(32, 600, seed=59, scale=0.05).to(torch.bfloat16)
    bias = randn(32, seed=60, scale=0.1)

    def run(y, r):
        return triton_route.norm_route(
            y, r, nw, 1e-5, gate, bias, 4, norm_topk_prob=True, scaling=2.5
        )

    got = [run(y, r) for _ in range(2)]  # the arrival counter is left at zero for the next launch
    x, h = triton_norms.add_rms_norm(y, r, nw, 1e-5)
    want = (x, h, *triton_route.route(x, gate, bias, 4, norm_topk_prob=True, scaling=2.5))
    for g in got:
        assert all(torch.equal(a, b) for a, b in zip(g, want))
        a, b = g[3].tf_aligned, want[3].tf_aligned
        assert torch.equal(a.block_expert, b.block_expert)
        used = (b.block_expert < 32).repeat_interleave(triton_moe.TINY_BLOCK_M)
        assert torch.equal(a.sorted_pairs[used], b.sorted_pairs[used])
    ys, rs = (
        randn(3, 600, seed=61, dtype=torch.bfloat16),
        randn(3, 600, seed=62, dtype=torch.bfloat16),
    )
    three = run(ys, rs)
    assert torch.equal(three[0][1:2], run(ys[1:2].clone(), rs[1:2].clone())[0])


def _experts(e, i, h, dtype, seed):
    w1 = randn(e, 2 * i, h, seed=seed, dtype=dtype, scale=0.2)  # w1 and w3 interleaved as HF
    w2 = randn(e, h, i, seed=seed + 1, dtype=dtype, scale=0.2)
    return list(w1[:, :i].unbind(0)), list(w1[:, i:].unbind(0)), list(w2.unbind(0))


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_moe_matches_reference_and_is_row_invariant(dtype, tol):
    n, h, i, e, k = 100, 32, 48, 6, 3  # 300 pairs: aligned by chunks, a row alone in one
    x = randn(n, h, seed=23, dtype=dtype)
    w1, w3, w2 = _experts(e, i, h, dtype, 24)
    assert triton_moe.stacked(w1).data_ptr() == w1[0].data_ptr()  # views, not a copy
    gate = randn(e, h, seed=26, dtype=dtype)
    weights, experts = ref_moe.route(x, gate, None, k, norm_topk_prob=True)
    want = ref_moe.moe(
        x.double(), weights.double(), experts, *[[t.double() for t in ws] for ws in (w1, w3, w2)]
    )
    got = triton_moe.moe(x, weights, experts, w1, w3, w2)
    assert rel(got, want) < tol
    for a, z in [(0, 1), (9, 10), (3, 40)]:
        sub = triton_moe.moe(x[a:z].clone(), weights[a:z].clone(), experts[a:z].clone(), w1, w3, w2)
        assert torch.equal(sub, got[a:z])


def test_decode_passes_of_few_pairs_an_expert_take_the_few_rows_blocks_and_keep_the_bits():
    """A decode-sized pass (more than TINY_ROWS rows) whose pairs come to at most FEW_PER_EXPERT
    an expert runs on 16-row blocks, others on 64-row ones: the rows' bits are those of a prompt
    pass either way."""
    dtype = torch.bfloat16
    n, h, i, e, k = 40, 32, 48, 24, 2  # 80 pairs over 24 experts: about 3 an expert
    assert triton_moe.pick(n, i, n * k, e)[0] == triton_moe.TINY_BLOCK_M
    assert triton_moe.pick(n, i, n * k, 6)[0] == triton_moe.SMALL_BLOCK_M
    assert triton_moe.pick(n, i)[0] == triton_moe.SMALL_BLOCK_M  # the dense FFN
    x = randn(300, h, seed=81, dtype=dtype)
    w1, w3, w2 = _experts(e, i, h, dtype, 82)
    weights, experts = ref_moe.route(
        x, randn(e, h, seed=84, dtype=dtype), None, k, norm_topk_prob=True
    )
    whole = triton_moe.moe(x, weights, experts, w1, w3, w2)  # 300 rows: the prompt tiles
    want = ref_moe.moe(
        x.double(), weights.double(), experts, *[[t.double() for t in ws] for ws in (w1, w3, w2)]
    )
    assert rel(whole, want) < 2e-2
    assert torch.equal(
        triton_moe.moe(x[:n].clone(), weights[:n].clone(), experts[:n].clone(), w1, w3, w2),
        whole[:n],
    )


def test_dense_ffn_on_its_own_tiles_keeps_the_bits(monkeypatch):
    """DENSE_TILES: a dense FFN whose shape has its own tiles (here narrower and with 128-long k
    steps, as gemma4's at 64 rows; the interpreter keeps 64-long ones) takes them for its
    class only, and its decode-sized pass's rows equal a prompt pass's. The interpreter's dot
    cannot show a tile changing bits: this checks the choice and that the narrow tile computes
    the right rows; tests/test_gpu_kernels.py checks the bits on the GPU."""
    dtype = torch.bfloat16
    h, i = 64, 48
    tiles = (
        triton_moe.SMALL_BLOCK_M,
        triton_moe.Tiles(16, 128, 4, 4),
        triton_moe.Tiles(32, 128, 4, 4),
    )
    monkeypatch.setattr(triton_moe, "DENSE_TILES", {(i, h, "small"): tiles})
    assert triton_moe.pick(40, i, hidden=h)[1].block_n == 16
    assert triton_moe.pick(40, i, hidden=h + 1)[1] == triton_moe.SMALL_SWIGLU_TILES
    assert triton_moe.pick(8, i, hidden=h)[1] == triton_moe.TINY_SWIGLU_TILES  # another class
    x = randn(300, h, seed=86, dtype=dtype)
    w1, w3 = (
        randn(i, h, seed=87, dtype=dtype, scale=0.2),
        randn(i, h, seed=88, dtype=dtype, scale=0.2),
    )
    w2 = randn(h, i, seed=89, dtype=dtype, scale=0.2)
    whole = triton_moe.gated_ffn(x, w1, w3, w2)  # 300 rows: the prompt tiles
    assert torch.equal(triton_moe.gated_ffn(x[:40].clone(), w1, w3, w2), whole[:40])


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_dense_ffn_split_over_k_keeps_rows_alone_equal_to_a_prompt_pass(dtype, tol, monkeypatch):
    """The dense FFN's gate/up and down products in K chunks summed in chunk order, a program a
    chunk for passes of up to DENSE_SPLIT_ROWS rows and one program walking the chunks in one
    loop for larger ones (on the walk class's tiles or the prompt tiles: the same bits): a row
    alone, a few rows and a decode-sized pass give the rows of a prompt pass, within the
    reference's tolerance, with the arrival counters back at zero."""
    from tensorfold.ops import triton_splitk

    h, i = 320, 300
    assert triton_moe.dense_splits(i, h) == 2 and triton_moe.dense_splits(h, i) == 2
    x = randn(300, h, seed=90, dtype=dtype)
    w1, w3 = (
        randn(i, h, seed=91, dtype=dtype, scale=0.2),
        randn(i, h, seed=92, dtype=dtype, scale=0.2),
    )
    w2 = randn(h, i, seed=93, dtype=dtype, scale=0.2)
    whole = triton_moe.gated_ffn(x, w1, w3, w2)  # 300 rows: the chunks walked in one program
    assert rel(whole, ref_moe.gated_ffn(x.double(), w1.double(), w3.double(), w2.double())) < tol
    # the walk class's own tiles (narrower than the prompt tiles, whose two accumulators a
    # product would spill on the GPU) for a split prompt pass only
    walk = (triton_moe.BLOCK_M, triton_moe.Tiles(64, 128, 8, 3), triton_moe.Tiles(64, 64, 4, 3))
    monkeypatch.setitem(triton_moe.DENSE_TILES, (i, h, "walk"), walk)
    assert triton_moe.pick(300, i, hidden=h, split=True)[1].block_n == 64
    assert triton_moe.pick(300, i, hidden=h)[1] == triton_moe.SWIGLU_TILES
    assert torch.equal(triton_moe.gated_ffn(x, w1, w3, w2), whole)
    assert triton_moe.DENSE_SPLIT_ROWS >= 16
    for a, z in [(7, 8), (0, 5), (0, 16), (20, 60)]:  # a program a chunk; 40 rows: one program
        assert torch.equal(triton_moe.gated_ffn(x[a:z].clone(), w1, w3, w2), whole[a:z])
    assert int(triton_splitk.counters(x.device, 1).abs().sum()) == 0


def test_dense_ffn_split_leaves_no_chunk_empty():
    """The dense FFN's K chunks from its shape alone: each chunk holds some of K, whatever K
    (9 steps cut in 8 chunks of 2 would leave three empty: fewer chunks instead)."""
    from tensorfold.ops import triton_splitk

    for n in (32, 64, 2112):
        for k in range(64, 40 * 128, 64):
            splits = triton_moe.dense_splits(n, k)
            chunk = triton_splitk.chunk(k, triton_moe.SPLIT_K_STEP, splits)
            assert (splits - 1) * chunk < k <= splits * chunk, (n, k, splits)
    assert triton_moe.dense_splits(64, 9 * 128) == 2


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_gated_ffn_matches_reference(dtype, tol):
    x = randn(70, 32, seed=27, dtype=dtype)
    w1, w3 = (
        randn(40, 32, seed=28, dtype=dtype, scale=0.2),
        randn(40, 32, seed=29, dtype=dtype, scale=0.2),
    )
    w2 = randn(32, 40, seed=30, dtype=dtype, scale=0.2)
    got = triton_moe.gated_ffn(x, w1, w3, w2)
    assert rel(got, ref_moe.gated_ffn(x.double(), w1.double(), w3.double(), w2.double())) < tol
    assert torch.equal(triton_moe.gated_ffn(x[7:8].clone(), w1, w3, w2), got[7:8])


def _ffns(n: int, dtype, seed: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """n rows of 32 through 6 experts of 48 (top 3) and through a dense FFN of 40, drawn from
    seeds seed to seed + 5: a call runs both, MoE then dense."""
    h, i, e, k = 32, 48, 6, 3
    xm = randn(n, h, seed=seed, dtype=dtype)
    w1, w3, w2 = _experts(e, i, h, dtype, seed + 1)
    weights, experts = ref_moe.route(
        xm, randn(e, h, seed=seed + 2, dtype=dtype), None, k, norm_topk_prob=True
    )
    dw1 = randn(40, h, seed=seed + 3, dtype=dtype, scale=0.2)
    dw3 = randn(40, h, seed=seed + 4, dtype=dtype, scale=0.2)
    dw2 = randn(h, 40, seed=seed + 5, dtype=dtype, scale=0.2)
    return lambda: (
        triton_moe.moe(xm, weights, experts, w1, w3, w2),
        triton_moe.gated_ffn(xm, dw1, dw3, dw2),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_choice_by_row_count_changes_no_bits(dtype, monkeypatch: pytest.MonkeyPatch):
    """The decode tiles and the prompt tiles give the same rows the same bits: only the M/N
    tiling changes with the row count, never the k order."""
    x = randn(150, 160, seed=31, dtype=dtype)
    w = randn(1100, 160, seed=32, dtype=dtype, scale=0.1)  # n >= 1024: the prompt tile is 128 wide
    b = randn(1100, seed=33, dtype=dtype)
    assert triton_linear.pick(1, 1100, 160) != triton_linear.pick(1000, 1100, 160)
    assert (
        triton_linear.pick(1, 1100, 160)[1].block_k
        == triton_linear.pick(1000, 1100, 160)[1].block_k
    )
    ffns = _ffns(60, dtype, 34)
    got = {}
    for small, rows in (("small", 1 << 30), ("prompt", -1)):
        monkeypatch.setattr(triton_linear, "SMALL_ROWS", rows)
        monkeypatch.setattr(triton_moe, "SMALL_ROWS", rows)
        got[small] = (
            triton_linear.linear(x, w, b),
            *ffns(),
        )
    for a, z in zip(got["small"], got["prompt"]):
        assert torch.equal(a, z)


def test_weight_prefetch_changes_no_bits(monkeypatch: pytest.MonkeyPatch):
    """The code before the wait that computes the prefetched rows (a no-op prefetch under the
    interpreter) runs with prefetch forced on, and no result changes."""
    dtype = torch.bfloat16
    x = randn(5, 160, seed=41, dtype=dtype)
    w = randn(300, 160, seed=42, dtype=dtype, scale=0.1)
    ffns = _ffns(4, dtype, 43)
    got = {}
    for pk in (0, 64):
        monkeypatch.setattr(triton_linear, "prefetch_k", lambda *_, pk=pk: pk)
        monkeypatch.setattr(triton_moe, "prefetch_k", lambda *_, pk=pk: pk)
        got[pk] = (
            triton_linear.linear(x, w),
            *ffns(),
        )
    for a, z in zip(got[0], got[64]):
        assert torch.equal(a, z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_split_in_programs_of_their_own_equals_the_chunks_in_one(dtype, monkeypatch):
    """The linear's K cut in chunks: a pass of a few rows gives each chunk its own program and the
    last to arrive adds the partials; a larger pass adds them in one program. Same bits for every
    row, and the arrival counters are back at zero after each call."""
    from tensorfold.ops import triton_splitk

    x = randn(40, 320, seed=40, dtype=dtype)
    w = randn(72, 320, seed=41, dtype=dtype, scale=0.1)
    b = randn(72, seed=42, dtype=dtype)
    assert triton_linear.splits_of(72, 320) > 2  # more than two: the order of the sum shows
    got = {}
    for mode, rows in (("split", 1 << 30), ("one", -1)):
        monkeypatch.setattr(triton_linear, "SMALL_ROWS", rows)
        monkeypatch.setattr(triton_linear, "TINY_ROWS", rows)
        got[mode] = triton_linear.linear(x, w, b)
        assert not triton_splitk.counters(x.device, 1).any()
    assert torch.equal(got["split"], got["one"])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel(got["split"], ref_linear.linear(x.double(), w.double(), b.double())) < tol
    monkeypatch.setattr(triton_linear, "TINY_ROWS", 1 << 30)
    for a, z in [(0, 1), (5, 6), (3, 20)]:
        assert torch.equal(triton_linear.linear(x[a:z].clone(), w, b), got["one"][a:z])


# --- the whole model through the kernels, and decode rounds through the graph runner ---


@pytest.fixture
def kernels_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """The ops take their Triton kernels for CPU tensors (interpreted); the lfm2 short conv
    works on the whole pass through ops.conv.gated_conv (as the graph runner needs)."""
    from tensorfold.ops import gpu

    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True)


def _tiny(dtype: torch.dtype):
    from dataclasses import replace

    dummy = pytest.importorskip("tensorfold_lfm2_moe.dummy")
    cfg = replace(
        dummy.SHAPES["LFM2-8B-A1B"],
        num_hidden_layers=3,
        layer_types=("conv", "full_attention", "conv"),
        vocab_size=128,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=6,
        num_dense_layers=1,
    )
    return dummy.build_dummy(cfg, "cpu", dtype, seed=0, std=0.1)


def _passes(runner, prompts, decode_rounds, fed=False):
    """Prefill every prompt in one pass, then greedy decode rounds; all logits, in order.
    fed: each round's tokens stay a tensor (`run_fed`), the rows' own are placeholders."""
    from tensorfold.engine.runner import open_stream

    streams = [open_stream(runner, i, 64) for i in range(len(prompts))]
    out = runner.run([s.rows(p) for s, p in zip(streams, prompts)])
    logits = [torch.cat(out)]
    for _ in range(decode_rounds):
        if fed:
            nxt = torch.stack([o[-1].argmax() for o in out])
            out = runner.run_fed([s.rows([0]) for s in streams], nxt)
        else:
            nxt = [[int(o[-1].argmax())] for o in out]
            out = runner.run([s.rows(t) for s, t in zip(streams, nxt)])
        logits.append(torch.cat(out))
    return logits


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_model_through_the_kernels_matches_the_torch_path(dtype, tol, kernels_on_cpu):
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.ops import gpu

    model = _tiny(dtype)
    prompts = [list(range(3, 40)), [7, 9, 11], list(range(50, 70))]
    got = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), prompts, 3)
    gpu.set_triton(False)
    want = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), prompts, 3)
    for g, w in zip(got, want):
        assert rel(g, w) < 5 * tol


def test_graph_runner_decode_rounds_equal_the_plain_runner(kernels_on_cpu):
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.engine.runner import ModelRunner

    model = _tiny(torch.bfloat16)
    prompts = [list(range(3, 40)), [7, 9, 11], list(range(50, 70))]
    plain = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), prompts, 3)
    runner = GraphRunner(model, num_pages=16, num_slots=4, page_rows=16, max_pages=4)
    graphed = _passes(runner, prompts, 3)
    assert runner.replays == 3 and list(runner.graphs) == [(4, 1)]  # 3 streams in the bucket of 4
    for g, p in zip(graphed, plain):
        assert torch.equal(g, p)


def test_decode_rounds_fed_on_the_device_equal_rounds_fed_by_the_host(kernels_on_cpu):
    """`run_fed` (the lanes' rounds sent ahead): the graph's input row of tokens copied from a
    tensor gives the bits the host's tokens give, through a graph bucket and eagerly."""
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.engine.runner import ModelRunner

    model = _tiny(torch.bfloat16)
    prompts = [list(range(3, 40)), [7, 9, 11], list(range(50, 70))]
    plain = _passes(ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), prompts, 3)
    runner = GraphRunner(model, num_pages=16, num_slots=4, page_rows=16, max_pages=4)
    graphed = _passes(runner, prompts, 3, fed=True)
    eager = _passes(
        ModelRunner(model, num_pages=16, num_slots=3, page_rows=16), prompts, 3, fed=True
    )
    assert runner.replays == 3
    for g, e, p in zip(graphed, eager, plain):
        assert torch.equal(g, p) and torch.equal(e, p)
