"""Linears and experts over fp8 weights on the GPU: e4m3 codes read as stored, dequantized in
registers; and the kernel an FFN's weights take, plain or fp8.

A weight is its raw parts: q, torch.float8_e4m3fn [N, K] (a linear) or [E, N, K] (stacked
experts); scale, float32 [..., ⌈(row0 + N)/bn⌉, ⌈K/bk⌉]; block (bn, bk): (128, 128) for the
block-scaled releases, (1, K) per channel, (N, K) per tensor; row0, where q's row 0 lies in
its first row block (0 but for a row cut inside a block); an `Fp8Weight`'s q, scale, block and
row0 (`parts`). The weight is `Fp8Weight.dequantize`: `q.float() * scale` spread over its
blocks, rounded to the activations' dtype. bk must be a multiple of 128 or cover all of K
(`fp8.kernel_reads`). A fused gate/up is passed as two weights, views of its codes and scales
(`gate_and_up`): the up half of Gemma-4-26B-A4B's experts (I = 704) starts 64 rows into a
128-row block, its row0.

Weight-only: each kernel is the bf16 kernel (triton_linear's, triton_moe's) with its weight
tile loaded as e4m3 and turned in registers into `(q.float() * s).to(x.dtype)`, the reference's
dequantized weight, before the same MMA (triton_util.weight_tile); their torch references are
tensorfold.ops.fp8's (linear_fp8_reference, moe_fp8_reference, gated_ffn_fp8_reference). So:
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

from typing import Any, Sequence

import torch

from ..family.fp8_weights import FP8_DTYPE, Fp8Weight
from . import triton_linear, triton_moe
from .fp8_dispatch import KERNEL_BK
from .triton_util import Fp8Scales, cdiv

FP8 = FP8_DTYPE
Block = tuple[int, int]
# one fp8 weight: (q, scale, block, row0)
Fp8Parts = tuple[torch.Tensor, torch.Tensor, Block, int]


def parts(w: Fp8Weight) -> Fp8Parts:
    """The kernels' parts of an fp8 weight."""
    return w.q, w.scale, w.block, w.row0


def scales_of(
    q: torch.Tensor, scale: torch.Tensor, block: Block, row0: int = 0, dims: int = 2
) -> Fp8Scales:
    """The kernels' view of an fp8 weight's scales (a stack of one for a lone matrix), after
    checking q (`dims` dimensions: 2 a matrix, 3 a stack of experts), scale, block and row0
    agree; a ValueError naming them when not."""
    bn, bk = int(block[0]), int(block[1])
    n, k = q.shape[-2:]
    ok = bn > 0 and bk > 0 and 0 <= row0 < bn
    want = (*q.shape[:-2], cdiv(row0 + n, bn), cdiv(k, bk)) if ok else None
    problem = ""
    if q.dim() != dims:
        problem = f"q has {q.dim()} dimensions, not {dims}"
    elif q.dtype != FP8:
        problem = f"q is {q.dtype}, not {FP8}"
    elif scale.dtype != torch.float32:
        problem = f"scale is {scale.dtype}, not torch.float32"
    elif want is None or tuple(scale.shape) != want:
        problem = f"scale {tuple(scale.shape)} is not {want}"
    elif bk < k and bk % KERNEL_BK:
        problem = f"bk {bk} is neither a multiple of 128 nor all of K ({k})"
    if problem:
        raise ValueError(f"fp8 weight q {tuple(q.shape)}, block {(bn, bk)}, row0 {row0}: {problem}")
    s = scale if scale.dim() == 3 else scale[None]
    if s.stride(-1) != 1:
        s = s.contiguous()
    return Fp8Scales(s, bn, bk, row0)


def linear_fp8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: Block,
    row0: int = 0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16 or fp32) @ w[N, K]ᵀ (+ bias [N]) -> [..., N] in x's dtype, stored in
    out_dtype (a float at least as wide), w the fp8 weight (q, scale, block, row0): the bits of
    triton_linear.linear(x, Fp8Weight(q, scale, block, row0).dequantize(x.dtype), bias,
    out_dtype)."""
    scales = scales_of(q, scale, block, row0)
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
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: Block,
    row0: int = 0,
    *,
    groups: int,
) -> torch.Tensor:
    """triton_linear.linear_groups with an fp8 weight (q [G·n, K], scale, block, row0):
    x [M, G·K] -> [G, M, n] in one launch (triton_linear.groups_fit must hold), the bits of
    triton_linear.linear_groups over the dequantized weight."""
    scales = scales_of(q, scale, block, row0)
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
    """triton_moe.moe with fp8 experts: w1, w3 (q [E, I, H], scale, block, row0), w2
    (q [E, H, I], scale, block, row0), w1 and w3 of one block shape (their row0 may differ: the
    halves of a fused gate/up); every other argument and the result as triton_moe.moe's, with
    the bits of triton_moe.moe over the dequantized experts."""
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
    """triton_moe.gated_ffn with fp8 weights: w1, w3 (q [I, H], scale, block, row0), w2
    (q [H, I], scale, block, row0); the bits of triton_moe.gated_ffn over the dequantized
    weights (its K split included)."""
    s1, s3, s2 = (scales_of(*w) for w in (w1, w3, w2))
    if (s1.block_n, s1.block_k) != (s3.block_n, s3.block_k):
        raise ValueError(f"w1's block {w1[2]} and w3's {w3[2]} differ")
    return triton_moe.gated_ffn(x, w1[0], w3[0], w2[0], act=act, limit=limit, scales=(s1, s3, s2))


# --- the kernel an FFN's weights take ---


def stack(ws: Sequence[torch.Tensor] | Sequence[Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """E x [A, B] -> [E, A, B], plain or fp8 (triton_moe.stack: a view when the experts are
    evenly spaced views of one storage, else a copy; an fp8 stack's codes and scales apart)."""
    first = ws[0]
    if not isinstance(first, Fp8Weight):
        return triton_moe.stack(ws)  # type: ignore[arg-type]
    fp8 = [w for w in ws if isinstance(w, Fp8Weight)]
    if len(fp8) != len(ws) or any((w.block, w.row0) != (first.block, first.row0) for w in fp8):
        raise ValueError("stack: the experts are not all fp8 of one block shape and row0")
    q = triton_moe.stack([w.q for w in fp8])
    return Fp8Weight(q, triton_moe.stack([w.scale for w in fp8]), first.block, first.row0)


def gate_and_up(gate_up: Any, i: int) -> tuple[Any, Any]:
    """The halves of a fused gate/up [..., 2I, H] (rows :I and I:, of each expert in a stack)
    as the kernels take them: views of a tensor; an fp8 weight's row cuts, views of its codes
    and of its scales (the up half's row0 where I falls inside a row block), made per call: no
    copy, nothing kept."""
    if not isinstance(gate_up, Fp8Weight):
        return (gate_up[..., :i, :], gate_up[..., i:, :])
    return gate_up.narrow(0, 0, i), gate_up.narrow(0, i, gate_up.shape[-2] - i)


def _stacked(ws: Any) -> Fp8Weight:
    out = ws if isinstance(ws, Fp8Weight) else stack(ws)
    assert isinstance(out, Fp8Weight)
    return out


def ffn_kernel(
    x: torch.Tensor,
    w1: torch.Tensor | Fp8Weight,
    w3: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    *,
    act: str = "silu",
    limit: float = 0.0,
) -> torch.Tensor:
    """The dense gated FFN through the kernel its weights take (fp8.kernels_take must hold):
    triton_moe.gated_ffn over plain ones, gated_ffn_fp8 over fp8 ones."""
    if isinstance(w1, Fp8Weight) and isinstance(w3, Fp8Weight) and isinstance(w2, Fp8Weight):
        return gated_ffn_fp8(x, parts(w1), parts(w3), parts(w2), act=act, limit=limit)
    assert isinstance(w1, torch.Tensor) and isinstance(w3, torch.Tensor)
    assert isinstance(w2, torch.Tensor)
    return triton_moe.gated_ffn(x, w1, w3, w2, act=act, limit=limit)


def moe_kernel(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Any,
    w3: Any,
    w2: Any,
    **options: Any,
) -> torch.Tensor:
    """The routed experts through the kernel their weights take (fp8.kernels_take must hold;
    each a stack or a sequence of experts): triton_moe.moe over plain ones, moe_fp8 over fp8
    ones; options as triton_moe.moe's."""
    first = w1 if isinstance(w1, (torch.Tensor, Fp8Weight)) else w1[0]
    if isinstance(first, Fp8Weight):
        s1, s3, s2 = (parts(_stacked(w)) for w in (w1, w3, w2))
        return moe_fp8(x, weights, experts, s1, s3, s2, **options)
    return triton_moe.moe(x, weights, experts, w1, w3, w2, **options)
