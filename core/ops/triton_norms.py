"""RMSNorm (and the residual add before it) on the GPU in Triton, as ops/norms.py computes it:
`weight · cast(x_fp32 · rsqrt(mean(x_fp32²) + eps))`.

A program takes ROWS rows, ROWS fixed by the row width alone; each row reduces only its own
elements, in an order fixed by the width, so no row depends on the others.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, cdiv, next_power_of_2


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    o_ptr,
    h_ptr,
    n_rows,
    D,
    eps,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    FP32_WEIGHT: tl.constexpr = False,
):
    after_prior(PDL)
    norm_rows(
        x_ptr,
        r_ptr,
        w_ptr,
        o_ptr,
        h_ptr,
        tl.program_id(0) * ROWS,
        n_rows,
        D,
        eps,
        HAS_RES,
        ROWS,
        BLOCK_D,
        SLOTS,
        FP32_WEIGHT,
    )


@triton.jit
def norm_rows(
    x_ptr,
    r_ptr,
    w_ptr,
    o_ptr,
    h_ptr,
    row0,
    n_rows,
    D,
    eps,
    HAS_RES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SLOTS: tl.constexpr,
    FP32_WEIGHT: tl.constexpr,
):
    """Rows row0 .. row0 + ROWS as a [ROWS, BLOCK_D] tile. SLOTS > 1: x is [n_rows, SLOTS, D],
    a MoE's slots, summed in slot order in fp32 and rounded to h's dtype first
    (triton_moe._slot_sum_kernel's sum). FP32_WEIGHT: w · x̂ in fp32, rounded once to o's
    dtype (else w · round(x̂)). A launch that calls this with the same ROWS, BLOCK_D and warps
    reduces a row in the same order (triton_route's norm + router of one row)."""
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    if SLOTS > 1:
        at = rows[:, None].to(tl.int64) * (SLOTS * D) + cols[None, :]
        acc = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, SLOTS):
            acc = acc + tl.load(x_ptr + at + j * D, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(h_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / D
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    if FP32_WEIGHT:
        out = w[None, :].to(tl.float32) * (xf * tl.math.rsqrt(var + eps)[:, None])
    else:
        normed = (xf * tl.math.rsqrt(var + eps)[:, None]).to(h_ptr.dtype.element_ty)
        out = w[None, :].to(tl.float32) * normed.to(tl.float32)
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


NORM_WARPS = 4  # part of a row's reduction order (norm_rows)


def rows_per_program(d: int) -> tuple[int, int]:
    """(ROWS, BLOCK_D) of a norm over rows of width d: from d alone."""
    block_d = next_power_of_2(d)
    return max(1, min(64, 4096 // block_d)), block_d


def _launch(x, res, weight, eps, slots=1, fp32_weight=False):
    """slots > 1 (x [..., slots, D], summed first) only with a residual. fp32_weight: the
    output in x's dtype (else x's and weight's promoted)."""
    assert slots == 1 or res is not None
    d = x.shape[-1]
    shape = x.shape if slots == 1 else x.shape[:-2] + x.shape[-1:]
    src = x.reshape(-1, slots * d).contiguous()
    n = src.shape[0]
    dtype = x.dtype if fp32_weight else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(n, d, dtype=dtype, device=x.device)
    h = torch.empty(n, d, dtype=x.dtype, device=x.device) if res is not None else src
    r = res.reshape(-1, d).contiguous() if res is not None else src
    per, block_d = rows_per_program(d)
    if n:
        _rms_norm_kernel[(cdiv(n, per),)](
            src,
            r,
            weight.contiguous(),
            out,
            h,
            n,
            d,
            eps,
            HAS_RES=res is not None,
            ROWS=per,
            BLOCK_D=block_d,
            SLOTS=slots,
            FP32_WEIGHT=fp32_weight,
            num_warps=NORM_WARPS,
            **launch_options(src),
        )
    return out.view(shape), h.view(shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fp32_weight: bool = False
) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D]; fp32_weight: w · x̂ in fp32, rounded once."""
    return _launch(x, None, weight, eps, fp32_weight=fp32_weight)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, slots: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual (in x's dtype); returns (rms_norm(h), h). x, residual [..., D]; with
    slots > 1, x is [..., slots, D], summed over its slots in order in fp32 and rounded first."""
    return _launch(x, residual, weight, eps, slots)
