"""Batch-invariant linear layers.

A BLAS picks its kernel (and so its summation order) by the row count: on the CPU the same row
gives different bits in a [1, K] and in a [300, K] product. Multiplying in fixed blocks of
ROW_BLOCK rows (the last one zero-padded) gives every row the same kernel whatever the pass
holds, so concurrent == solo.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..family.fp8_weights import Fp8Weight
from .gpu import use_triton

ROW_BLOCK = 16


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]ᵀ (+ bias) -> [..., N], each row independent of the others; in
    x's dtype, then as out_dtype (a wider float, exactly: `linear(x, w).to(out_dtype)`; on the
    GPU stored so by the product's own launch). An fp8 weight: `linear_fp8`."""
    if isinstance(weight, Fp8Weight):
        return linear_fp8(x, weight, bias, out_dtype)
    if use_triton(x) and x.dtype == weight.dtype:
        from .triton_linear import linear as triton_linear

        return triton_linear(x, weight, bias, out_dtype)
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    pad = (-m) % ROW_BLOCK
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    wt = weight.t()
    for i in range(0, rows.shape[0], ROW_BLOCK):
        torch.mm(rows[i : i + ROW_BLOCK], wt, out=out[i : i + ROW_BLOCK])
    out = out[:m]
    if bias is not None:
        out = out + bias
    if out_dtype is not None:
        out = out.to(out_dtype)
    return out.reshape(*lead, weight.shape[0])


def linear_fp8(
    x: torch.Tensor,
    weight: Fp8Weight,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]ᵀ for an fp8 weight: by definition the product with the weight
    dequantized to x's dtype (each element q · scale in fp32, rounded once), so rows stay as
    independent as `linear`'s. On the GPU triton_fp8.linear_fp8 reads the codes and scales as
    stored, with the bits of the bf16 kernel over that dequantized weight; a weight whose column
    blocks it cannot read (fp8.kernel_reads: a cut off the blocks) is dequantized here first."""
    if use_triton(x):
        from .fp8_dispatch import kernel_reads

        if kernel_reads(weight):
            from . import triton_fp8

            return triton_fp8.linear_fp8(x, *triton_fp8.parts(weight), bias, out_dtype)
    return linear(x, weight.dequantize(x.dtype), bias, out_dtype)


def linear_groups(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, groups: int) -> torch.Tensor:
    """Products of one pass's adjacent column groups with their weights, stacked: x [M, G·K],
    weight [G·n, K] (the G weights' rows in order) -> [G, M, n], group g being
    linear(x[:, g·K:(g+1)·K], weight[g·n:(g+1)·n]). On the GPU one launch where the groups fit
    its tiles (triton_linear.groups_fit; an fp8 weight's in triton_fp8.linear_groups_fp8), else
    a product a group; each row's bits its own."""
    m, gk = x.shape
    n, k = weight.shape
    if gk != groups * k or n % groups:
        raise ValueError(
            f"linear_groups: x {tuple(x.shape)} and weight {tuple(weight.shape)} do "
            f"not make {groups} groups (x [M, {groups}·K], weight [{groups}·n, K])"
        )
    if use_triton(x) and _one_launch(x, weight, groups):
        from . import triton_fp8, triton_linear

        if isinstance(weight, Fp8Weight):
            return triton_fp8.linear_groups_fp8(x, *triton_fp8.parts(weight), groups=groups)
        return triton_linear.linear_groups(x, weight, groups)
    step = n // groups
    return torch.stack(
        [
            linear(x[:, g * k : (g + 1) * k], weight[g * step : (g + 1) * step])
            for g in range(groups)
        ]
    )


def _one_launch(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, groups: int) -> bool:
    """Whether linear_groups runs its groups in one Triton launch: they fit the tiles, and the
    weight is x's dtype or fp8 with blocks the fp8 kernels read (else each group's product
    dequantizes, linear_fp8)."""
    from . import triton_linear
    from .fp8_dispatch import kernel_reads

    n, k = weight.shape
    if not triton_linear.groups_fit(n, k, groups):
        return False
    return kernel_reads(weight) if isinstance(weight, Fp8Weight) else x.dtype == weight.dtype
