"""NeoX rotary embeddings on the GPU in Triton, rounding as ops/rope.py does in the model dtype:
out = round(x·cos) + round(rotate_half(x)·sin), each product and the sum rounded. Elementwise
per (row, head): no row depends on another. `norm_rope` first normalises each head (RMSNorm over
the head, a program a row, its tile from the head count and width alone), in the same launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior


NORM_NONE, NORM_ROUNDED, NORM_FP32 = 0, 1, 2  # _rope_kernel's NORM


@triton.jit
def _norm_rope_heads(src, dst, live, w_ptr, c_row, s_row, eps,
                     HALF: tl.constexpr, NORM: tl.constexpr):
    """The heads at src ([HEADS, 1] pointers to each head's first value; live masks the padding
    heads) normalised as NORM says, rotated by the row's cos, sin at c_row, s_row, and stored at
    dst in dst's dtype. NORM RMS-normalises a head over its 2·HALF values: NORM_ROUNDED
    w · round(x̂), rounded (ops/norms.py); NORM_FP32 x̂·w in fp32, rounded once (Gemma4RMSNorm)."""
    i = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + i, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=live, other=0.0).to(tl.float32)
    dt = dst.dtype.element_ty
    if NORM != 0:
        r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + i).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
        if NORM == 2:
            x1 = (x1 * r[:, None] * w1).to(dt).to(tl.float32)
            x2 = (x2 * r[:, None] * w2).to(dt).to(tl.float32)
        else:
            x1 = (w1 * (x1 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            x2 = (w2 * (x2 * r[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    c1 = tl.load(c_row + i).to(tl.float32)
    c2 = tl.load(c_row + HALF + i).to(tl.float32)
    s1 = tl.load(s_row + i).to(tl.float32)
    s2 = tl.load(s_row + HALF + i).to(tl.float32)
    lo = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(dst + i, lo.to(dt), mask=live)
    tl.store(dst + HALF + i, hi.to(dt), mask=live)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _rope_kernel(
    x_ptr, w_ptr, c_ptr, s_ptr, o_ptr, n_rows, heads, stride_xn, stride_xh, stride_cn, eps,
    HALF: tl.constexpr, HEADS: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Each head of a row rotated; NORM first RMS-normalises it (_norm_rope_heads)."""
    after_prior(PDL)
    row = tl.program_id(0)
    h = tl.arange(0, HEADS)[:, None]
    src = x_ptr + row.to(tl.int64) * stride_xn + h * stride_xh
    dst = o_ptr + row.to(tl.int64) * heads * 2 * HALF + h * 2 * HALF
    _norm_rope_heads(src, dst, h < heads, w_ptr, c_ptr + row * stride_cn,
                     s_ptr + row * stride_cn, eps, HALF, NORM)


def _warps(heads: int, d: int, norm: int) -> int:
    """Warps for a program whose widest tile is [heads, D]: from the widths alone, never the
    row count (the warps can set a norm's reduction order)."""
    return 4 if norm and heads * d > 4096 else 2


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None,
            eps: float, norm: int) -> torch.Tensor:
    n, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
    if n:
        _rope_kernel[(n,)](
            x, weight.contiguous() if weight is not None else cos, cos, sin, out, n, heads,
            x.stride(0), x.stride(1), cos.stride(0), float(eps), HALF=d // 2,
            HEADS=triton.next_power_of_2(heads), NORM=norm,
            num_warps=_warps(heads, d, norm), **launch_options(x),
        )
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos, sin [N, D] (x's dtype) -> [N, H, D]."""
    return _launch(x, cos, sin, None, 0.0, NORM_NONE)


def norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    fp32_weight: bool,
) -> torch.Tensor:
    """x [N, H, D]; weight [D]; cos, sin [N, D] (x's dtype) -> [N, H, D]: each head normalised
    (fp32_weight: NORM_FP32, else NORM_ROUNDED), then rotated."""
    return _launch(x, cos, sin, weight, eps, NORM_FP32 if fp32_weight else NORM_ROUNDED)
