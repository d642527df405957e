"""The fp8 weights' kernels on the GPU (`pytest -m gpu`, on a CUDA machine), at the families'
real shapes, for each block kind (128 x 128 blocks, per channel, per tensor):

- each kernel gives the bits of the bf16 kernel over the dequantized weight (the same tiles and
  K split, the weight dequantized in registers as `dequantize` does it), across every row class;
- a row alone gives the bits it gives in passes of 1 .. 700 rows (8 and 64 among them);
- each is within bf16 rounding of its torch reference (the CPU path's arithmetic, on the GPU
  with the kernels off).
"""

from __future__ import annotations

import pytest
import torch

from tensorfold.ops import gpu, triton_fp8, triton_linear, triton_moe
from tensorfold.ops.fp8 import (
    Fp8Weight,
    gated_ffn_fp8_reference,
    linear_fp8_reference,
    moe_fp8_reference,
    quantize_blocks,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
ROWS = [1, 2, 3, 7, 8, 16, 33, 64, 65, 255, 256, 257, 700]  # every row class of the tiles


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(BF16)


def fp8(w: torch.Tensor, kind: str) -> triton_fp8.Fp8Parts:
    n, k = w.shape[-2:]
    block = {"blocks": (128, 128), "channel": (1, k), "tensor": (n, k)}[kind]
    return triton_fp8.parts(quantize_blocks(w, block))


def dequantize(
    q: torch.Tensor,
    s: torch.Tensor,
    block: tuple[int, int],
    row0: int = 0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight the kernels multiply by (Fp8Weight.dequantize, the one dequantization)."""
    return Fp8Weight(q, s, block, row0).dequantize(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_rows_invariant(fn, x: torch.Tensor, *row_args: torch.Tensor) -> torch.Tensor:
    """fn over the first and the last m rows, for every m in ROWS, gives each row the bits of
    the full pass; returns the full pass."""
    full = fn(x, *row_args)
    for m in ROWS:
        for start in {0, x.shape[0] - m}:
            part = fn(
                x[start : start + m].clone(), *[a[start : start + m].clone() for a in row_args]
            )
            assert torch.equal(part, full[start : start + m]), f"rows {start}:{start + m}"
    return full


def torch_path(fn, *args, **kw):
    """fn with the Triton kernels off (the CPU path's arithmetic, on the GPU)."""
    gpu.set_triton(False)
    try:
        return fn(*args, **kw)
    finally:
        gpu.set_triton(True)


# (N, K): LFM2-8B-A1B's q/o and its fused q+k+v (tuned, unsplit), Gemma-4-26B-A4B's q and o,
# GLM-5.3-Flash's q_a (4096 -> 1536), in 128 x 128 blocks; two in the other kinds
LINEARS = [(2048, 2048), (3072, 2048), (4096, 2816), (2816, 4096), (1536, 4096)]
LINEAR_CASES = [(*nk, "blocks") for nk in LINEARS] + [
    (2048, 2048, "channel"),
    (2816, 4096, "tensor"),
]


@pytest.mark.parametrize("n, k, kind", LINEAR_CASES)
def test_linear_fp8_rows_alone_equal_batches_and_the_bf16_kernels_bits(n, k, kind):
    w = fp8(randn(n, k, seed=1, scale=0.05), kind)
    x = randn(700, k, seed=2)
    b = randn(n, seed=3)
    got = assert_rows_invariant(lambda x: triton_fp8.linear_fp8(x, *w, bias=b), x)
    dequantized = dequantize(*w, BF16)
    for m in (1, 8, 64, 700):
        want = triton_linear.linear(x[:m].contiguous(), dequantized, b)
        assert torch.equal(got[:m], want), m
    assert rel(got, torch_path(linear_fp8_reference, x, *w, bias=b)) < 1e-2


@pytest.mark.parametrize("kind", ["blocks", "channel"])
def test_linear_groups_fp8_rows_alone_equal_batches_and_the_bf16_launchs_bits(kind):
    """GLM-5.3-Flash's f_b and g_b (2 x [8192, 128]) over adjacent columns of a [M, 576] pass."""
    w = fp8(randn(2 * 8192, 128, seed=6, scale=0.05), kind)
    maps = randn(700, 576, seed=7)

    def run(m):
        return triton_fp8.linear_groups_fp8(m[:, :256], *w, groups=2).transpose(0, 1)

    got = assert_rows_invariant(run, maps)
    want = triton_linear.linear_groups(maps[:, :256], dequantize(*w, BF16), 2)
    assert torch.equal(got, want.transpose(0, 1))


def test_linear_fp8_stores_fp32_as_the_rounded_product_widened():
    w = fp8(randn(2048, 2048, seed=4, scale=0.05), "blocks")
    x = randn(9, 2048, seed=5)
    wide = triton_fp8.linear_fp8(x, *w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide, triton_fp8.linear_fp8(x, *w).float())


# (experts, width, hidden, top k): LFM2-8B-A1B's, Gemma-4-26B-A4B's (704 wide: the last row
# and k blocks partial), GLM-5.3-Flash's (2048 x 4096, 32 of its 288 experts); in 128 x 128
# blocks, two in the other kinds
MOES = [(32, 1792, 2048, 4), (128, 704, 2816, 8), (32, 2048, 4096, 8)]
MOE_CASES = [(*m, "blocks") for m in MOES] + [(*MOES[1], "channel"), (*MOES[0], "tensor")]


def _experts(e: int, i: int, h: int, kind: str, seed: int):
    gate_up = randn(e, 2 * i, h, seed=seed, scale=0.05)  # gate and up quantized apart
    w1, w3 = fp8(gate_up[:, :i], kind), fp8(gate_up[:, i:], kind)
    w2 = fp8(randn(e, h, i, seed=seed + 1, scale=0.05), kind)
    return w1, w3, w2


@pytest.mark.parametrize("e, i, h, k, kind", MOE_CASES)
def test_moe_fp8_rows_alone_equal_batches_and_the_bf16_kernels_bits(e, i, h, k, kind):
    from tensorfold.ops import moe as ref_moe

    ws = _experts(e, i, h, kind, 10)
    x = randn(700, h, seed=12)
    weights, experts = ref_moe.route(x, randn(e, h, seed=13), None, k, norm_topk_prob=True)

    def run(x, wt, ex):
        return triton_fp8.moe_fp8(x, wt, ex, *ws)

    got = assert_rows_invariant(run, x, weights, experts)
    dequantized = [dequantize(*w, BF16) for w in ws]
    for m in (1, 8, 64, 700):
        want = triton_moe.moe(x[:m], weights[:m], experts[:m], *dequantized)
        assert torch.equal(got[:m], want), m
    ref = torch_path(moe_fp8_reference, x, weights, experts, *ws)
    assert rel(got, ref) < 1e-2


def test_gemma4s_fused_gate_up_cut_inside_a_block_keeps_the_bf16_kernels_bits():
    """Gemma-4-26B-A4B's experts as they ship: gate/up [128, 1408, 2816] in 128 x 128 blocks
    over the fused rows, cut by gate_and_up into views, the up half 64 rows into row block 5
    (row0 64). The grouped kernels, the dense FFN over one expert's halves and a linear over
    the up half: the bits of the bf16 kernels over the fused weight's dequantized rows, a row
    alone as in every pass, within bf16 rounding of the reference."""
    from tensorfold.ops import moe as ref_moe

    e, i, h, k = 128, 704, 2816, 8
    gate_up = quantize_blocks(randn(e, 2 * i, h, seed=50, scale=0.05))
    gate, up = triton_fp8.gate_and_up(gate_up, i)
    assert (gate.row0, up.row0) == (0, 64) and up.q.data_ptr() == gate_up.q[:, i:].data_ptr()
    down = quantize_blocks(randn(e, h, i, seed=51, scale=0.05))
    ws = [triton_fp8.parts(w) for w in (gate, up, down)]
    whole = gate_up.dequantize(BF16)
    dequantized = [whole[:, :i], whole[:, i:], down.dequantize(BF16)]
    assert torch.equal(dequantize(*ws[1], dtype=BF16), dequantized[1])
    x = randn(700, h, seed=52)
    weights, experts = ref_moe.route(x, randn(e, h, seed=53), None, k, norm_topk_prob=True)
    options = dict(act="gelu_tanh", slot_dtype=torch.float32)

    def run(x, wt, ex):
        return triton_fp8.moe_fp8(x, wt, ex, *ws, **options)

    got = assert_rows_invariant(run, x, weights, experts)
    for m in (1, 8, 64, 700):
        want = triton_moe.moe(x[:m], weights[:m], experts[:m], *dequantized, **options)
        assert torch.equal(got[:m], want), m
    ref = torch_path(moe_fp8_reference, x, weights, experts, *ws, act="gelu_tanh", fp32_slots=True)
    assert rel(got, ref) < 1e-2
    dense = [(q[5], s[5], block, row0) for q, s, block, row0 in ws]
    got = assert_rows_invariant(lambda x: triton_fp8.gated_ffn_fp8(x, *dense), x)
    plain = [w[5].contiguous() for w in dequantized]
    assert torch.equal(got, triton_moe.gated_ffn(x, *plain))
    got = assert_rows_invariant(lambda x: triton_fp8.linear_fp8(x, *dense[1]), x)
    assert torch.equal(got, triton_linear.linear(x, plain[1]))


@pytest.mark.parametrize("i, h, kind", [(2112, 2816, "blocks"), (7168, 2048, "channel")])
def test_gated_ffn_fp8_rows_alone_equal_batches_and_the_bf16_kernels_bits(i, h, kind):
    """Gemma-4-26B-A4B's and LFM2-8B-A1B's dense FFNs: their own tiles and K split."""
    w1, w3 = (
        fp8(randn(i, h, seed=20, scale=0.05), kind),
        fp8(randn(i, h, seed=21, scale=0.05), kind),
    )
    w2 = fp8(randn(h, i, seed=22, scale=0.05), kind)
    x = randn(700, h, seed=23)
    got = assert_rows_invariant(lambda x: triton_fp8.gated_ffn_fp8(x, w1, w3, w2), x)
    dequantized = [dequantize(*w, BF16) for w in (w1, w3, w2)]
    for m in (1, 8, 64, 700):
        assert torch.equal(got[:m], triton_moe.gated_ffn(x[:m], *dequantized)), m
    ref = torch_path(gated_ffn_fp8_reference, x, w1, w3, w2)
    assert rel(got, ref) < 1e-2


def test_fp8_kernels_replay_from_a_cuda_graph_with_the_eager_bits():
    """A decode round's launches captured in a graph (as the engine replays them) give the eager
    bits: nothing in the fp8 path syncs with the host or allocates per call outside the pool."""
    from tensorfold.ops import moe as ref_moe

    lin = fp8(randn(2048, 2048, seed=30, scale=0.05), "blocks")
    ws = _experts(32, 1792, 2048, "blocks", 31)
    x = randn(1, 2048, seed=33)
    weights, experts = ref_moe.route(x, randn(32, 2048, seed=34), None, 4, norm_topk_prob=True)

    def step():
        y = triton_fp8.linear_fp8(x, *lin)
        return triton_fp8.moe_fp8(y, weights, experts, *ws)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_fp8_tiles_of_their_own_keep_a_rows_bits(monkeypatch):
    """Candidate fp8 tiles for a few rows (128-long k steps, other widths and stages:
    bench/fp8_kernels.py --tiles) give a row alone the bits of the same row in a 700-row pass
    on the bf16 tiles: a linear whose bf16 tiles step 64 long (Gemma-4's o), LFM2-8B-A1B's
    experts and Gemma-4's dense FFN (a program a chunk)."""
    from tensorfold.ops import moe as ref_moe

    lin = fp8(randn(2816, 4096, seed=40, scale=0.05), "blocks")
    assert triton_linear.pick(1, 2816, 4096)[1].block_k == 64
    ws = _experts(32, 1792, 2048, "blocks", 41)
    dense = [
        fp8(randn(*s, seed=43 + j, scale=0.05), "blocks")
        for j, s in enumerate([(2112, 2816), (2112, 2816), (2816, 2112)])
    ]
    x, xd = randn(700, 4096, seed=46), randn(700, 2816, seed=47)
    xm = randn(700, 2048, seed=48)
    wt, ex = ref_moe.route(xm, randn(32, 2048, seed=49), None, 4, norm_topk_prob=True)
    full = (
        triton_fp8.linear_fp8(x, *lin),
        triton_fp8.moe_fp8(xm, wt, ex, *ws),
        triton_fp8.gated_ffn_fp8(xd, *dense),
    )
    for t in (
        triton_linear.Tiles(32, 128, 4, 6),
        triton_linear.Tiles(64, 128, 4, 4),
        triton_linear.Tiles(16, 128, 2, 6),
    ):
        monkeypatch.setitem(triton_linear.FP8_TUNED, (2816, 4096), t)
        monkeypatch.setattr(triton_moe, "FP8_FEW_ROWS_TILES", (t, t))
        for m in (1, 3, 16):
            assert torch.equal(triton_fp8.linear_fp8(x[:m].clone(), *lin), full[0][:m]), (t, m)
            one = triton_fp8.moe_fp8(xm[:m].clone(), wt[:m].clone(), ex[:m].clone(), *ws)
            assert torch.equal(one, full[1][:m]), (t, m)
            assert torch.equal(triton_fp8.gated_ffn_fp8(xd[:m].clone(), *dense), full[2][:m])
