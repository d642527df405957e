"""NeoX rotary embeddings on the GPU in Triton, rounding as ops/rope.py does in the model dtype:
out = round(x·cos) + round(rotate_half(x)·sin), each product and the sum rounded. Elementwise
per (row, head): no row depends on another. `norm_rope` first normalises each head (RMSNorm over
the head, a program a row, its tile from the head count and width alone), in the same launch;
`qkv_norm_rope_write` does so for a layer's q and k heads and also stores its new K and V rows;
`qkv_heads` makes gemma4's q, k and v heads (v normalised without a weight, not rotated)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, next_power_of_2

NORM_NONE, NORM_ROUNDED, NORM_FP32 = 0, 1, 2  # _rope_kernel's NORM


@triton.jit
def _norm_rope_heads(
    src, dst, live, w_ptr, c_row, s_row, eps, HALF: tl.constexpr, NORM: tl.constexpr
):
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


@triton.jit
def _norm_heads(src, dst, live, eps, HALF: tl.constexpr):
    """The heads at src RMS-normalised without a weight (x̂ in fp32, rounded once: Gemma4RMSNorm
    with_scale=False), a head's squares summed as _norm_rope_heads sums them, stored at dst."""
    i = tl.arange(0, HALF)[None, :]
    x1 = tl.load(src + i, mask=live, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=live, other=0.0).to(tl.float32)
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    dt = dst.dtype.element_ty
    tl.store(dst + i, (x1 * r[:, None]).to(dt), mask=live)
    tl.store(dst + HALF + i, (x2 * r[:, None]).to(dt), mask=live)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _rope_kernel(
    x_ptr,
    w_ptr,
    c_ptr,
    s_ptr,
    o_ptr,
    n_rows,
    heads,
    stride_xn,
    stride_xh,
    stride_cn,
    eps,
    HALF: tl.constexpr,
    HEADS: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Each head of a row rotated; NORM first RMS-normalises it (_norm_rope_heads)."""
    after_prior(PDL)
    row = tl.program_id(0)
    h = tl.arange(0, HEADS)[:, None]
    src = x_ptr + row.to(tl.int64) * stride_xn + h * stride_xh
    dst = o_ptr + row.to(tl.int64) * heads * 2 * HALF + h * 2 * HALF
    _norm_rope_heads(
        src,
        dst,
        h < heads,
        w_ptr,
        c_ptr + row * stride_cn,
        s_ptr + row * stride_cn,
        eps,
        HALF,
        NORM,
    )


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _qkv_kernel(
    x_ptr,
    wq_ptr,
    wk_ptr,
    c_ptr,
    s_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    index_ptr,
    n_rows,
    q_heads,
    kv_heads,
    stride_xn,
    stride_xh,
    stride_cn,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    eps,
    HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row `row` of x [N, Hq + 2·Hkv, D] (its q, k and v heads): the q heads normalised and
    rotated (_norm_rope_heads) into q [N, Hq, D], the k heads likewise into k[index[row]], the v
    heads copied into v[index[row]]."""
    after_prior(PDL)
    row = tl.program_id(0)
    dest = tl.load(index_ptr + row).to(tl.int64)
    x_row = x_ptr + row.to(tl.int64) * stride_xn
    c_row, s_row = c_ptr + row * stride_cn, s_ptr + row * stride_cn
    hq = tl.arange(0, Q_HEADS)[:, None]
    _norm_rope_heads(
        x_row + hq * stride_xh,
        q_ptr + row.to(tl.int64) * q_heads * 2 * HALF + hq * 2 * HALF,
        hq < q_heads,
        wq_ptr,
        c_row,
        s_row,
        eps,
        HALF,
        NORM,
    )
    hk = tl.arange(0, KV_HEADS)[:, None]
    live = hk < kv_heads
    _norm_rope_heads(
        x_row + (q_heads + hk) * stride_xh,
        k_ptr + dest * stride_kn + hk * stride_kh,
        live,
        wk_ptr,
        c_row,
        s_row,
        eps,
        HALF,
        NORM,
    )
    j = tl.arange(0, 2 * HALF)[None, :]
    v = tl.load(x_row + (q_heads + kv_heads + hk) * stride_xh + j, mask=live)
    tl.store(v_ptr + dest * stride_vn + hk * stride_vh + j, v, mask=live)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _heads_kernel(
    x_ptr,
    wq_ptr,
    wk_ptr,
    c_ptr,
    s_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    n_rows,
    q_heads,
    kv_heads,
    v_first,
    stride_xn,
    stride_xh,
    stride_cn,
    eps,
    HALF: tl.constexpr,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Row `row` of x's heads [N, *, D]: q heads 0.. and k heads q_heads.. normalised and rotated
    (_norm_rope_heads) into q [N, Hq, D] and k [N, Hkv, D]; v heads v_first.. normalised without
    a weight (_norm_heads) into v [N, Hkv, D]."""
    after_prior(PDL)
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xn
    c_row, s_row = c_ptr + row * stride_cn, s_ptr + row * stride_cn
    hq = tl.arange(0, Q_HEADS)[:, None]
    _norm_rope_heads(
        x_row + hq * stride_xh,
        q_ptr + row.to(tl.int64) * q_heads * 2 * HALF + hq * 2 * HALF,
        hq < q_heads,
        wq_ptr,
        c_row,
        s_row,
        eps,
        HALF,
        NORM,
    )
    hk = tl.arange(0, KV_HEADS)[:, None]
    live = hk < kv_heads
    kv_row = row.to(tl.int64) * kv_heads * 2 * HALF + hk * 2 * HALF
    _norm_rope_heads(
        x_row + (q_heads + hk) * stride_xh,
        k_ptr + kv_row,
        live,
        wk_ptr,
        c_row,
        s_row,
        eps,
        HALF,
        NORM,
    )
    _norm_heads(x_row + (v_first + hk) * stride_xh, v_ptr + kv_row, live, eps, HALF)


def _warps(heads: int, d: int, norm: int) -> int:
    """Warps for a program whose widest tile is [heads, D]: from the widths alone, never the
    row count (the warps can set a norm's reduction order)."""
    return 4 if norm and heads * d > 4096 else 2


def _launch(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    norm: int,
) -> torch.Tensor:
    n, heads, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
    if n:
        _rope_kernel[(n,)](
            x,
            weight.contiguous() if weight is not None else cos,
            cos,
            sin,
            out,
            n,
            heads,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            float(eps),
            HALF=d // 2,
            HEADS=next_power_of_2(heads),
            NORM=norm,
            num_warps=_warps(heads, d, norm),
            **launch_options(x),
        )
    return out


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos, sin [N, D] (x's dtype) -> [N, H, D]."""
    return _launch(x, cos, sin, None, 0.0, NORM_NONE)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fp32_weight: bool,
) -> torch.Tensor:
    """x [N, H, D]; weight [D]; cos, sin [N, D] (x's dtype) -> [N, H, D]: each head normalised
    (fp32_weight: NORM_FP32, else NORM_ROUNDED), then rotated."""
    return _launch(x, cos, sin, weight, eps, NORM_FP32 if fp32_weight else NORM_ROUNDED)


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """qkv [N, Hq + 2·Hkv, D] (q, k, v heads); q_norm, k_norm [D]; cos, sin [N, D]; k_dst, v_dst
    [R, Hkv, D] (qkv's dtype); index [N] -> q [N, Hq, D]: norm_rope(q) (NORM_ROUNDED), with
    norm_rope(k) and v stored at rows index of k_dst and v_dst, in one launch. The bits of
    norm_rope's launches when q's and k's take the same warps (Hq·D <= 4096: LFM2-8B-A1B's 2048):
    the warps set the layout a head's squares are summed in (tests/test_kernel_layouts.py)."""
    n, heads, d = qkv.shape
    kv_heads = k_dst.shape[1]
    q_heads = heads - 2 * kv_heads
    assert k_dst.dtype == v_dst.dtype == qkv.dtype and v_dst.shape[1:] == (kv_heads, d)
    assert k_dst.stride(-1) == 1 and v_dst.stride(-1) == 1
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin, index = cos.contiguous(), sin.contiguous(), index.contiguous()
    q = torch.empty(n, q_heads, d, dtype=qkv.dtype, device=qkv.device)
    if n:
        _qkv_kernel[(n,)](
            qkv,
            q_norm.contiguous(),
            k_norm.contiguous(),
            cos,
            sin,
            q,
            k_dst,
            v_dst,
            index,
            n,
            q_heads,
            kv_heads,
            qkv.stride(0),
            qkv.stride(1),
            cos.stride(0),
            k_dst.stride(0),
            k_dst.stride(1),
            v_dst.stride(0),
            v_dst.stride(1),
            float(eps),
            HALF=d // 2,
            Q_HEADS=next_power_of_2(q_heads),
            KV_HEADS=next_power_of_2(kv_heads),
            NORM=NORM_ROUNDED,
            num_warps=_warps(max(q_heads, kv_heads), d, NORM_ROUNDED),
            **launch_options(qkv),
        )
    return q


def qkv_heads(
    heads: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    v_first: int,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gemma4's attention inputs from one product's heads [N, *, D] in one launch: (q, k, v),
    q = norm_rope(heads[:, :q_heads], q_norm) [N, Hq, D] and k = norm_rope(the next kv_heads,
    k_norm) [N, Hkv, D] (NORM_FP32: x̂·w rounded once), v [N, Hkv, D] the kv_heads from v_first
    normalised without a weight (v_first = q_heads under k_eq_v: V from the raw k heads).
    The q heads' bits are norm_rope's launch's; the k heads' too where that launch takes the
    same warps (Hkv·D and Hq·D both within 4096, or both over: tests/test_kernel_layouts.py)."""
    n, _, d = heads.shape
    assert q_norm.dtype == k_norm.dtype == torch.float32
    assert v_first + kv_heads <= heads.shape[1] and q_heads + kv_heads <= heads.shape[1]
    if heads.stride(-1) != 1:
        heads = heads.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty(n, q_heads, d, dtype=heads.dtype, device=heads.device)
    k = torch.empty(n, kv_heads, d, dtype=heads.dtype, device=heads.device)
    v = torch.empty_like(k)
    if n:
        _heads_kernel[(n,)](
            heads,
            q_norm.contiguous(),
            k_norm.contiguous(),
            cos,
            sin,
            q,
            k,
            v,
            n,
            q_heads,
            kv_heads,
            v_first,
            heads.stride(0),
            heads.stride(1),
            cos.stride(0),
            float(eps),
            HALF=d // 2,
            Q_HEADS=next_power_of_2(q_heads),
            KV_HEADS=next_power_of_2(kv_heads),
            NORM=NORM_FP32,
            num_warps=_warps(max(q_heads, kv_heads), d, NORM_FP32),
            **launch_options(heads),
        )
    return q, k, v
