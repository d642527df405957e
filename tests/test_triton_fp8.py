"""The fp8 weights' kernels (core/ops/triton_fp8) on the CPU under TRITON_INTERPRET=1, at small
sizes: each equals the bf16 kernel over the dequantized weight bit for bit, is within rounding
of its torch reference, and gives a row the same bits alone as in a pass; for each block kind
(128 x 128 blocks, per channel, per tensor)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.ops import moe as ref_moe  # noqa: E402
from tensorfold.ops import triton_fp8, triton_linear, triton_moe, triton_splitk  # noqa: E402
from tensorfold.ops.fp8 import (
    Fp8Weight,
    gated_ffn_fp8_reference,
    linear_fp8_reference,
    moe_fp8_reference,
    quantize_blocks,
)  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _round_to_nearest_even():
    """The interpreter truncates fp32 -> bf16: give it the GPU's rounding (as
    tests/test_triton_kernels.py does), so bf16 results compare bit for bit."""
    with testing.interpreter_rounds_like_the_gpu():
        yield


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
KINDS = ("blocks", "channel", "tensor")


def block_of(kind: str, n: int, k: int) -> tuple[int, int]:
    return {"blocks": (128, 128), "channel": (1, k), "tensor": (n, k)}[kind]


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def fp8(w: torch.Tensor, kind: str) -> triton_fp8.Fp8Parts:
    block = block_of(kind, *w.shape[-2:])
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


def test_quantize_and_dequantize_keep_each_block_within_e4m3s_rounding():
    """A block's largest magnitude maps to 448; dequantize spreads each block's scale over its
    rows and columns (partial blocks at the edges included) and rounds once to the dtype."""
    w = randn(2, 200, 300, seed=0)
    for kind in KINDS:
        q, s, block, _ = fp8(w, kind)
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert s.shape == (2, -(-200 // block[0]), -(-300 // block[1]))
        back = dequantize(q, s, block)
        assert back.dtype == torch.float32
        assert float(((back - w).abs() / w.abs().clamp_min(s.max())).max()) < 2**-4
        assert float(q.float().abs().amax()) == 448.0
        assert torch.equal(dequantize(q, s, block, dtype=torch.bfloat16), back.bfloat16())
    q, s, block, _ = fp8(w, "blocks")  # the scale of block (1, 2) at rows 128.., columns 256..
    assert torch.equal(dequantize(q, s, block)[0, 130, 260], q[0, 130, 260].float() * s[0, 1, 2])


def test_a_weight_that_does_not_fit_its_scales_is_refused_by_name():
    q, s, block, _ = fp8(randn(64, 256, seed=1), "blocks")
    x = randn(2, 256, seed=2)
    for bad, words in (
        ((q.float(), s, block), "torch.float32, not torch.float8_e4m3fn"),
        ((q, s.bfloat16(), block), "scale is torch.bfloat16"),
        ((q, s[:, :1], block), "scale (1, 1) is not (1, 2)"),
        ((q[None], s[None], block), "q has 3 dimensions, not 2"),
        (
            triton_fp8.parts(quantize_blocks(q.float(), (128, 64))),
            "bk 64 is neither a multiple of 128",
        ),
    ):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            triton_fp8.linear_fp8(x, *bad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_fp8_is_the_bf16_kernel_over_the_dequantized_weight(kind, dtype):
    """linear_fp8 == triton_linear.linear over the dequantized weight, bit for bit, with the K
    split of the weight's shape (a program a chunk up to SPLIT_ROWS rows, the chunks in one
    program above): a row alone, a few rows and 70 give each row the same bits."""
    n, k = 72, 320
    assert triton_linear.splits_of(n, k) > 1
    x = randn(70, k, seed=3).to(dtype)
    w = fp8(randn(n, k, seed=4, scale=0.1), kind)
    got = triton_fp8.linear_fp8(x, *w)
    assert got.dtype == dtype and got.shape == (70, n)
    assert torch.equal(got, triton_linear.linear(x, dequantize(*w, dtype)))
    assert rel(got, linear_fp8_reference(x.double(), *w)) < TOL[dtype]
    for a, z in [(0, 1), (5, 6), (3, 20)]:
        assert torch.equal(triton_fp8.linear_fp8(x[a:z].clone(), *w), got[a:z])
    assert not triton_splitk.counters(x.device, 1).any()


def test_linear_fp8_adds_its_bias_and_stores_the_rounded_product_widened():
    x = randn(3, 256, seed=5).bfloat16()
    w = fp8(randn(40, 256, seed=6, scale=0.1), "blocks")
    b = randn(40, seed=7).bfloat16()
    got = triton_fp8.linear_fp8(x[None], *w, bias=b, out_dtype=torch.float32)
    assert got.shape == (1, 3, 40) and got.dtype == torch.float32
    want = triton_linear.linear(x, dequantize(*w, torch.bfloat16), b)
    assert torch.equal(got[0], want.float())
    ref = linear_fp8_reference(x, *w, bias=b, out_dtype=torch.float32)
    assert ref.dtype == torch.float32 and rel(got[0], ref) < 2e-2


@pytest.mark.parametrize("kind", ["blocks", "channel"])
def test_linear_groups_fp8_is_the_bf16_launch_over_the_dequantized_weight(kind):
    """Two groups of 128 rows over adjacent column groups of a wider pass, in one launch: the
    bits of triton_linear.linear_groups over the dequantized weight, a row alone as in 20."""
    wide = randn(20, 2 * 64 + 8, seed=50).bfloat16()
    x = wide[:, :128]
    w = fp8(randn(256, 64, seed=51, scale=0.1), kind)
    got = triton_fp8.linear_groups_fp8(x, *w, groups=2)
    assert got.shape == (2, 20, 128)
    want = triton_linear.linear_groups(x, dequantize(*w, torch.bfloat16), 2)
    assert torch.equal(got, want)
    assert torch.equal(triton_fp8.linear_groups_fp8(x[4:5].clone(), *w, groups=2), got[:, 4:5])
    with pytest.raises(ValueError, match="in 3 groups"):
        triton_fp8.linear_groups_fp8(x, *w, groups=3)


def _experts(kind: str, dtype: torch.dtype, seed: int):
    """4 experts of 136 over 256 (two row blocks and two k blocks each way, the last ones
    partial), gate and up quantized apart, as views of one stack like a checkpoint's; 12 rows
    routed top 2."""
    e, i, h = 4, 136, 256
    gate_up = randn(e, 2 * i, h, seed=seed, scale=0.2)
    w1, w3 = fp8(gate_up[:, :i], kind), fp8(gate_up[:, i:], kind)
    w2 = fp8(randn(e, h, i, seed=seed + 1, scale=0.2), kind)
    x = randn(12, h, seed=seed + 2).to(dtype)
    gate = randn(e, h, seed=seed + 3).to(dtype)
    weights, experts = ref_moe.route(x, gate, None, 2, norm_topk_prob=True)
    return x, weights, experts, (w1, w3, w2)


@pytest.mark.parametrize(
    "kind, dtype",
    [("blocks", torch.bfloat16), ("channel", torch.bfloat16), ("tensor", torch.float32)],
)
def test_moe_fp8_is_the_bf16_kernel_over_the_dequantized_experts(kind, dtype):
    x, weights, experts, ws = _experts(kind, dtype, 10)
    got = triton_fp8.moe_fp8(x, weights, experts, *ws)
    dequantized = [dequantize(*w, dtype) for w in ws]
    assert torch.equal(got, triton_moe.moe(x, weights, experts, *dequantized))
    ref = moe_fp8_reference(x.double(), weights.double(), experts, *ws)
    assert rel(got, ref) < TOL[dtype]
    for a, z in [(0, 1), (7, 8)]:
        one = triton_fp8.moe_fp8(x[a:z].clone(), weights[a:z].clone(), experts[a:z].clone(), *ws)
        assert torch.equal(one, got[a:z])


def test_moe_fp8_takes_every_option_of_the_bf16_entry_point():
    """gelu_tanh, fp32 slots, the slots unsummed, each add rounded and a term added last: the
    bits of triton_moe.moe over the dequantized experts, each."""
    dtype = torch.bfloat16
    x, weights, experts, ws = _experts("blocks", dtype, 20)
    dequantized = [dequantize(*w, dtype) for w in ws]
    plus = randn(*x.shape, seed=25).to(dtype)
    for options in (
        dict(act="gelu_tanh", slot_dtype=torch.float32, sum_slots=False),
        dict(act="silu_clamp", limit=0.5, round_sum=True, plus=plus),
    ):
        got = triton_fp8.moe_fp8(x, weights, experts, *ws, **options)  # type: ignore[arg-type]
        want = triton_moe.moe(x, weights, experts, *dequantized, **options)  # type: ignore[arg-type]
        assert got.shape == want.shape and torch.equal(got, want), options


@pytest.mark.parametrize("kind", ["blocks", "channel"])
def test_gated_ffn_fp8_is_the_bf16_kernel_over_the_dequantized_weights(kind):
    """The dense FFN, its K split over two chunks (a program a chunk for a few rows, one walk
    for a prompt pass): the bf16 kernel's bits, a row alone as in 40."""
    dtype = torch.bfloat16
    x, _, _, ws = _experts(kind, dtype, 30)
    x = randn(40, x.shape[1], seed=35).to(dtype)
    dense = [(q[0], s[0], block, row0) for q, s, block, row0 in ws]
    assert triton_moe.dense_splits(*dense[0][0].shape) == 2
    got = triton_fp8.gated_ffn_fp8(x, *dense, act="gelu_tanh")
    dequantized = [dequantize(*w, dtype) for w in dense]
    assert torch.equal(got, triton_moe.gated_ffn(x, *dequantized, act="gelu_tanh"))
    ref = gated_ffn_fp8_reference(x.double(), *dense, act="gelu_tanh")
    assert rel(got, ref) < 2e-2
    for a, z in [(3, 4), (0, 5)]:
        assert torch.equal(
            triton_fp8.gated_ffn_fp8(x[a:z].clone(), *dense, act="gelu_tanh"), got[a:z]
        )


def test_fused_gate_up_blocks_must_match_between_halves():
    x, weights, experts, (w1, w3, w2) = _experts("blocks", torch.bfloat16, 40)
    w3_channel = fp8(dequantize(*w3), "channel")
    with pytest.raises(ValueError, match="w1's block"):
        triton_fp8.moe_fp8(x, weights, experts, w1, w3_channel, w2)


# --- a row cut inside a 128-row block (row0): the up half of a fused gate/up ---

# I: the up half starts 8 rows into row block 1; or 64 rows in, as Gemma-4-26B-A4B's (I = 704)
# starts in block 5
CUT_WIDTHS = [136, 192]


def _fused_experts(i: int, seed: int):
    """4 experts' gate/up [4, 2I, 256] quantized as one in 128 x 128 blocks (as Gemma 4's
    fused experts ship) and cut into halves by gate_and_up; down a row cut 64 rows into a
    block of a taller stack; 12 rows routed top 2, in bf16."""
    e, h = 4, 256
    gate_up = quantize_blocks(randn(e, 2 * i, h, seed=seed, scale=0.2))
    gate, up = triton_fp8.gate_and_up(gate_up, i)
    assert (gate.row0, up.row0) == (0, i % 128) and up.q.data_ptr() == gate_up.q[:, i:].data_ptr()
    down = quantize_blocks(randn(e, 64 + h, i, seed=seed + 1, scale=0.2)).narrow(0, 64, h)
    x = randn(12, h, seed=seed + 2).bfloat16()
    router = randn(e, h, seed=seed + 3).bfloat16()
    weights, experts = ref_moe.route(x, router, None, 2, norm_topk_prob=True)
    return x, weights, experts, [triton_fp8.parts(w) for w in (gate, up, down)]


@pytest.mark.parametrize("i", CUT_WIDTHS)
def test_linear_fp8_reads_a_row_cut_inside_a_block(i):
    """Rows I..2I of a [2I, 320] weight (row0 I % 128; two K chunks): the bf16 kernel's bits
    over the whole weight's dequantized rows, a row alone as in 20; and linear_groups_fp8 over
    two 128-row groups that start 64 rows into a block."""
    dtype = torch.bfloat16
    whole = quantize_blocks(randn(2 * i, 320, seed=60, scale=0.1))
    w = triton_fp8.parts(whole.narrow(0, i, i))
    assert w[3] == i % 128 and triton_linear.splits_of(i, 320) > 1
    x = randn(20, 320, seed=61).to(dtype)
    got = triton_fp8.linear_fp8(x, *w)
    want = triton_linear.linear(x, whole.dequantize(dtype)[i:].contiguous())
    assert torch.equal(got, want) and torch.equal(
        got, triton_linear.linear(x, dequantize(*w, dtype))
    )
    assert rel(got, linear_fp8_reference(x.double(), *w)) < TOL[dtype]
    assert torch.equal(triton_fp8.linear_fp8(x[7:8].clone(), *w), got[7:8])
    groups = triton_fp8.parts(
        quantize_blocks(randn(320, 64, seed=62, scale=0.1)).narrow(0, 64, 256)
    )
    xg = randn(5, 128, seed=63).to(dtype)
    got = triton_fp8.linear_groups_fp8(xg, *groups, groups=2)
    assert torch.equal(got, triton_linear.linear_groups(xg, dequantize(*groups, dtype), 2))


@pytest.mark.parametrize("i", CUT_WIDTHS)
def test_moe_fp8_reads_the_halves_of_a_fused_gate_up_as_views(i):
    """Experts whose up half starts inside a row block, and whose down rows do: the bf16
    kernel's bits over the dequantized halves (each the fused weight's rows), within rounding
    of the reference, a row alone as in the pass."""
    x, weights, experts, ws = _fused_experts(i, 70)
    got = triton_fp8.moe_fp8(x, weights, experts, *ws, slot_dtype=torch.float32)
    dequantized = [dequantize(*w, dtype=torch.bfloat16) for w in ws]
    want = triton_moe.moe(x, weights, experts, *dequantized, slot_dtype=torch.float32)
    assert torch.equal(got, want)
    ref = moe_fp8_reference(x.double(), weights.double(), experts, *ws)
    assert rel(got, ref) < TOL[torch.bfloat16]
    one = triton_fp8.moe_fp8(
        x[5:6].clone(), weights[5:6].clone(), experts[5:6].clone(), *ws, slot_dtype=torch.float32
    )
    assert torch.equal(one, got[5:6])


@pytest.mark.parametrize("i", CUT_WIDTHS)
def test_gated_ffn_fp8_reads_the_halves_of_a_fused_gate_up_as_views(i):
    """The dense FFN over one expert's halves (its K split over two chunks): the bf16 kernel's
    bits over the dequantized halves, a row alone as in 9."""
    _, _, _, ws = _fused_experts(i, 80)
    dense = [(q[1], s[1], block, row0) for q, s, block, row0 in ws]
    x = randn(9, 256, seed=85).bfloat16()
    got = triton_fp8.gated_ffn_fp8(x, *dense, act="gelu_tanh")
    dequantized = [dequantize(*w, dtype=torch.bfloat16) for w in dense]
    assert torch.equal(got, triton_moe.gated_ffn(x, *dequantized, act="gelu_tanh"))
    ref = gated_ffn_fp8_reference(x.double(), *dense, act="gelu_tanh")
    assert rel(got, ref) < 2e-2
    assert torch.equal(triton_fp8.gated_ffn_fp8(x[2:3].clone(), *dense, act="gelu_tanh"), got[2:3])


def test_fp8_tiles_of_their_own_take_a_few_rows_on_the_gpu_with_the_bf16_chunks(monkeypatch):
    """triton_linear.FP8_TUNED and triton_moe.FP8_FEW_ROWS_TILES (none shipped: the bf16
    tiles) apply to passes of a few rows on the GPU only (the interpreter's dots would sum their
    steps differently), a linear's only where its BLOCK_K divides the bf16 tiles' chunk; the
    GPU suite checks they keep the bits (tests/test_gpu_fp8_kernels.py)."""
    t = triton_linear.Tiles(32, 64, 4, 4)
    own = triton_linear.Tiles(64, 128, 4, 6)
    monkeypatch.setitem(triton_linear.FP8_TUNED, (2816, 4096), own)
    monkeypatch.setattr(triton_linear, "interpreting", lambda: False)
    assert triton_linear.fp8_tiles(1, 2816, 4096, 1024, t) == own
    assert triton_linear.fp8_tiles(triton_linear.TINY_ROWS + 1, 2816, 4096, 1024, t) == t
    assert triton_linear.fp8_tiles(1, 2816, 4096, 704, t) == t  # 5.5 steps of 128
    assert triton_linear.fp8_tiles(1, 2048, 4096, 1024, t) == t  # another shape
    monkeypatch.setattr(triton_linear, "interpreting", lambda: True)
    assert triton_linear.fp8_tiles(1, 2816, 4096, 1024, t) == t
    sw, dn = triton_moe.TINY_SWIGLU_TILES, triton_moe.TINY_DOWN_TILES
    assert triton_moe.fp8_tiles(triton_moe.TINY_BLOCK_M, sw, dn) == (sw, dn)  # none shipped
    few = (triton_moe.Tiles(32, 128, 4, 4), triton_moe.Tiles(64, 128, 4, 4))
    monkeypatch.setattr(triton_moe, "FP8_FEW_ROWS_TILES", few)
    monkeypatch.setattr(triton_moe, "interpreting", lambda: False)
    assert triton_moe.fp8_tiles(triton_moe.TINY_BLOCK_M, sw, dn) == few
    assert triton_moe.fp8_tiles(triton_moe.SMALL_BLOCK_M, sw, dn) == (sw, dn)
    monkeypatch.setattr(triton_moe, "interpreting", lambda: True)
    assert triton_moe.fp8_tiles(triton_moe.TINY_BLOCK_M, sw, dn) == (sw, dn)
