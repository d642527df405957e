"""Linears and experts over fp8 weights on the GPU: e4m3 codes read as stored, dequantized in
registers, with their torch references.

A weight is three raw tensors: q, torch.float8_e4m3fn [N, K] (a linear) or [E, N, K] (stacked
experts); scale, float32 [..., ⌈N/bn⌉, ⌈K/bk⌉]; block (bn, bk): (128, 128) for the
block-scaled releases, (1, K) per channel, (N, K) per tensor. The weight is
`q.float() * scale` spread over its blocks, rounded to the activations' dtype (`dequantize`).
bk must be a multiple of 128 or cover all of K; scale rows count from q's own row 0 (a fused
gate/up is passed as two weights, each with the scales of its rows: quantize the halves apart,
as the FP8 releases ship gate_proj and up_proj, when I is not a multiple of bn).

Weight-only: each kernel is the bf16 kernel (triton_linear's, triton_moe's) with its weight
tile loaded as e4m3 and turned in registers into `(q.float() * s).to(x.dtype)`, the reference's
dequantized weight, before the same MMA (triton_util.weight_tile). So:
- the tiles and the K split come from the weight's shape alone, as the bf16 kernels' do: a
  row's bits never depend on the pass;
- a product's bits are those of the bf16 kernel over the dequantized weight (checked under the
  interpreter here and on the GPU by tests/test_gpu_fp8_kernels.py), and the fp8 path inherits
  every exactness property of the bf16 one;
- no fp8 tensor-core products: they would need the activations quantized (a per-row scale keeps
  rows independent) and change the bits; not built until a prompt pass measures it faster
  (docs/performance.md, "fp8 weights").
A BK step (64 or 128 long) then lies in one k block, and reads one scale per output column next
to its BK x BN codes (the columns of one row block share the address).
"""

from __future__ import annotations

import torch

from . import triton_linear, triton_moe
from .triton_util import Fp8Scales, cdiv

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
Block = tuple[int, int]
# one fp8 weight: (q, scale, block)
Fp8Parts = tuple[torch.Tensor, torch.Tensor, Block]


def scales_of(q: torch.Tensor, scale: torch.Tensor, block: Block, dims: int = 2) -> Fp8Scales:
    """The kernels' view of an fp8 weight's scales (a stack of one for a lone matrix), after
    checking q (`dims` dimensions: 2 a matrix, 3 a stack of experts), scale and block agree; a
    ValueError naming them when not."""
    bn, bk = int(block[0]), int(block[1])
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], cdiv(n, bn), cdiv(k, bk)) if bn > 0 and bk > 0 else None
    problem = ""
    if q.dim() != dims:
        problem = f"q has {q.dim()} dimensions, not {dims}"
    elif q.dtype != FP8:
        problem = f"q is {q.dtype}, not {FP8}"
    elif scale.dtype != torch.float32:
        problem = f"scale is {scale.dtype}, not torch.float32"
    elif want is None or tuple(scale.shape) != want:
        problem = f"scale {tuple(scale.shape)} is not {want}"
    elif bk < k and bk % 128:
        problem = f"bk {bk} is neither a multiple of 128 nor all of K ({k})"
    if problem:
        raise ValueError(f"fp8 weight q {tuple(q.shape)}, block {(bn, bk)}: {problem}")
    s = scale if scale.dim() == 3 else scale[None]
    if s.stride(-1) != 1:
        s = s.contiguous()
    return Fp8Scales(s, bn, bk)


def linear_fp8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: Block,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) @ w[N, K]ᵀ (+ bias [N]) -> [..., N] in x's dtype, stored in
    out_dtype (a float at least as wide), w the fp8 weight (q, scale, block): the bits of
    triton_linear.linear(x, dequantize(q, scale, block, x.dtype), bias, out_dtype)."""
    scales = scales_of(q, scale, block)
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = q.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    triton_linear._launch(rows, q, bias, out, out.stride(0), 1, scales)
    return out.reshape(*lead, n)


def linear_groups_fp8(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: Block, groups: int
) -> torch.Tensor:
    """triton_linear.linear_groups with an fp8 weight (q [G·n, K], scale, block): x [M, G·K]
    -> [G, M, n] in one launch (triton_linear.groups_fit must hold), the bits of
    triton_linear.linear_groups over the dequantized weight."""
    scales = scales_of(q, scale, block)
    m = x.shape[0]
    n, k = q.shape
    if not triton_linear.groups_fit(n, k, groups) or x.shape[1] != groups * k:
        raise ValueError(
            f"linear_groups_fp8: x {tuple(x.shape)} and q {tuple(q.shape)} in {groups} groups; "
            "needs x [M, G·K] and rows a group a multiple of 128 and of the tile"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(groups, m, n // groups, dtype=x.dtype, device=x.device)
    triton_linear._launch(x, q.contiguous(), None, out, n // groups, groups, scales)
    return out


def moe_fp8(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Fp8Parts,
    w3: Fp8Parts,
    w2: Fp8Parts,
    *,
    act: str = "silu",
    limit: float = 0.0,
    slot_dtype: torch.dtype | None = None,
    round_sum: bool = False,
    plus: torch.Tensor | None = None,
    sum_slots: bool = True,
) -> torch.Tensor:
    """triton_moe.moe with fp8 experts: w1, w3 (q [E, I, H], scale, block), w2 (q [E, H, I],
    scale, block), w1 and w3 of one block shape; every other argument and the result as
    triton_moe.moe's, with the bits of triton_moe.moe over the dequantized experts."""
    s1, s3, s2 = (scales_of(*w, dims=3) for w in (w1, w3, w2))
    if (s1.block_n, s1.block_k) != (s3.block_n, s3.block_k):
        raise ValueError(f"w1's block {w1[2]} and w3's {w3[2]} differ")
    return triton_moe.moe(
        x,
        weights,
        experts,
        w1[0],
        w3[0],
        w2[0],
        act=act,
        limit=limit,
        slot_dtype=slot_dtype,
        round_sum=round_sum,
        plus=plus,
        sum_slots=sum_slots,
        scales=(s1, s3, s2),
    )


def gated_ffn_fp8(
    x: torch.Tensor,
    w1: Fp8Parts,
    w3: Fp8Parts,
    w2: Fp8Parts,
    *,
    act: str = "silu",
    limit: float = 0.0,
) -> torch.Tensor:
    """triton_moe.gated_ffn with fp8 weights: w1, w3 (q [I, H], scale, block), w2 (q [H, I],
    scale, block); the bits of triton_moe.gated_ffn over the dequantized weights (its K split
    included)."""
    s1, s3, s2 = (scales_of(*w) for w in (w1, w3, w2))
    if (s1.block_n, s1.block_k) != (s3.block_n, s3.block_k):
        raise ValueError(f"w1's block {w1[2]} and w3's {w3[2]} differ")
    return triton_moe.gated_ffn(x, w1[0], w3[0], w2[0], act=act, limit=limit, scales=(s1, s3, s2))


# --- the torch references ---


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, block: Block, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [..., N, K] e4m3 -> `q.float() * s` in fp32, s each element's block scale, rounded to
    dtype: the weight the kernels multiply by."""
    bn, bk = block
    n, k = q.shape[-2:]
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    lead = q.shape[:-2]
    w = q.float()
    if nb * bn != n or kb * bk != k:
        w = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    w = w.reshape(*lead, nb, bn, kb, bk) * scale.float().reshape(*lead, nb, 1, kb, 1)
    return w.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].to(dtype)


def quantize(w: torch.Tensor, block: Block) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q e4m3, scale float32 [..., ⌈N/bn⌉, ⌈K/bk⌉]): each block divided by
    amax(|block|) / 448 (1 for a block of zeros), as the FP8 releases store it. For tests and
    benchmarks."""
    bn, bk = block
    n, k = w.shape[-2:]
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    lead = w.shape[:-2]
    wf = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    wf = wf.view(*lead, nb, bn, kb, bk)
    amax = wf.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous()
    return q, scale.view(*lead, nb, kb).contiguous()


def linear_fp8_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: Block,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """linear_fp8's arithmetic in torch: ops.linear.linear over the weight dequantized to x's
    dtype."""
    from .linear import linear

    return linear(x, dequantize(q, scale, block, x.dtype), bias, out_dtype)


def moe_fp8_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Fp8Parts,
    w3: Fp8Parts,
    w2: Fp8Parts,
    **kw,
) -> torch.Tensor:
    """moe_fp8's arithmetic in torch: ops.moe.moe (its keywords: act, limit, fp32_slots) over
    the experts dequantized to x's dtype."""
    from .moe import moe

    w = [dequantize(*parts, x.dtype).unbind(0) for parts in (w1, w3, w2)]
    out = moe(x, weights, experts, *w, **kw)
    assert isinstance(out, torch.Tensor)
    return out


def gated_ffn_fp8_reference(
    x: torch.Tensor, w1: Fp8Parts, w3: Fp8Parts, w2: Fp8Parts, **kw
) -> torch.Tensor:
    """gated_ffn_fp8's arithmetic in torch: ops.moe.gated_ffn over the weights dequantized."""
    from .moe import gated_ffn

    return gated_ffn(x, *(dequantize(*parts, x.dtype) for parts in (w1, w3, w2)), **kw)
