"""MLA on the GPU in Triton; mla.py and ops.head_linear (the CPU path) are its torch reference.

`sparse_mla`: the absorbed form, MQA over the latent (keys = values = the latent row c_j):
out_h(t) = Σ_j softmax_j(q̃_h(t) · c_j · scale) c_j over the keys the indexer selected for t.
A program takes one query row and HEADS_BLOCK heads, so its accumulator [HEADS_BLOCK, r] fp32
stays in registers. It visits the row's selected pools in ascending position order,
POOLS_PER_STEP pools a step, then its tail (the rows of its own incomplete pool up to t), with an
online softmax in fp32: the steps a row takes depend only on its selection and position, so its
bits do not depend on the other rows of the pass. Latent rows are read through the stream's
page table, and only rows at or before t that the selection names are loaded. fp8 latent rows
(SCALED) are converted exactly to q's dtype; a row's scale multiplies its scores after the sum
over r and its probabilities before the sum over rows, as mla.sparse_attention does.

`head_linear`: a separate linear map per head, x [n, heads, K] @ w[heads, N, K]ᵀ, with K walked
from 0 upwards in BLOCK_K steps fixed by the weight's shape (never by n): batch-invariant, where
torch.bmm / cuBLAS pick their reduction by the row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.ops.gpu import launch_options
from tensorfold.ops.pass_meta import PassMeta
from tensorfold.ops.triton_util import after_prior, cdiv, interpreting, mma, next_power_of_2

HEADS_BLOCK = 16
POOLS_PER_STEP = 2  # 32 latent rows a step at kpool 16
HEAD_BLOCK_M = 64
HEAD_BLOCK_N = 64
HEAD_BLOCK_K = 64


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _head_linear_kernel(
    x_ptr,
    w_ptr,
    o_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xh,
    stride_wh,
    stride_wn,
    stride_om,
    stride_oh,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + head * stride_xh + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + head * stride_wh + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kin = (k0 + rk) < K
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=(rn[None, :] < N) & kin[:, None], other=0.0)
        acc = mma(a, b, acc, IEEE, INTERP)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    o_ptrs = o_ptr + head * stride_oh + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [n, heads, K]; weight [heads, N, K] -> [n, heads, N] in x's dtype."""
    n, heads, k = x.shape
    out_n = weight.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(n, heads, out_n, dtype=x.dtype, device=x.device)
    if n:
        block_k = min(HEAD_BLOCK_K, next_power_of_2(k))
        grid = (cdiv(out_n, HEAD_BLOCK_N), cdiv(n, HEAD_BLOCK_M), heads)
        _head_linear_kernel[grid](
            x,
            weight,
            out,
            n,
            out_n,
            k,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            out.stride(1),
            IEEE=x.dtype == torch.float32,
            INTERP=interpreting(),
            BLOCK_M=HEAD_BLOCK_M,
            BLOCK_N=HEAD_BLOCK_N,
            BLOCK_K=block_k,
            num_warps=4,
            **launch_options(x),
        )
    return out


@triton.jit
def _attend(
    q,
    c,
    cs,
    visible,
    m_i,
    l_i,
    acc,
    scale,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step: q [HB, R], c [KT, R] (keys = values), cs [KT] their fp8 scales
    (used when SCALED), visible [KT]."""
    if SCALED:
        c = c.to(q.dtype)
    sc = mma(q, tl.trans(c), tl.zeros((q.shape[0], c.shape[0]), dtype=tl.float32), IEEE, INTERP)
    if SCALED:
        sc = sc * cs[None, :]
    sc = tl.where(visible[None, :], sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SCALED:
        p = p * cs[None, :]
    acc = mma(p.to(c.dtype), c, acc * alpha[:, None], IEEE, INTERP)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_ts", "stride_tp", "n_sel"])
def _sparse_mla_kernel(
    q_ptr,
    c_ptr,
    cs_ptr,
    o_ptr,
    sel_ptr,
    pos_ptr,
    row_stream,
    table_ptr,
    stride_ts,
    stride_tp,
    page_rows,
    n_sel,
    scale,
    stride_qn,
    stride_qh,
    stride_cn,
    stride_csn,
    stride_on,
    stride_oh,
    stride_sn,
    HEADS: tl.constexpr,
    HB: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    KPOOL: tl.constexpr,
    PPS: tl.constexpr,
    SELP: tl.constexpr,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    hok = h < HEADS
    s = tl.load(row_stream + row)
    t = tl.load(pos_ptr + row).to(tl.int32)
    d = tl.arange(0, RP)
    dok = d < R
    q = tl.load(
        q_ptr + row * stride_qn + h[:, None] * stride_qh + d[None, :],
        mask=hok[:, None] & dok[None, :],
        other=0.0,
    )
    e = tl.arange(0, SELP)
    chosen = tl.load(sel_ptr + row * stride_sn + e, mask=e < n_sel, other=-1)
    count = tl.sum((chosen >= 0).to(tl.int32), axis=0)  # chosen pools come first, ascending
    m_i = tl.full((HB,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((HB,), dtype=tl.float32)
    acc = tl.zeros((HB, RP), dtype=tl.float32)
    u = tl.arange(0, PPS * KPOOL)
    for e0 in range(0, count, PPS):
        entry = e0 + u // KPOOL
        ok = entry < count
        pool = tl.load(sel_ptr + row * stride_sn + entry, mask=ok, other=0)
        j = pool * KPOOL + u % KPOOL
        page = tl.load(table_ptr + s * stride_ts + (j // page_rows) * stride_tp, mask=ok, other=0)
        crow = page.to(tl.int64) * page_rows + j % page_rows
        c = tl.load(
            c_ptr + crow[:, None] * stride_cn + d[None, :],
            mask=ok[:, None] & dok[None, :],
            other=0.0,
        )
        cs = tl.zeros((PPS * KPOOL,), dtype=tl.float32)
        if SCALED:
            cs = tl.load(cs_ptr + crow * stride_csn, mask=ok, other=0.0)
        m_i, l_i, acc = _attend(q, c, cs, ok, m_i, l_i, acc, scale, SCALED, IEEE, INTERP)
    # the tail: rows [(t + 1) // KPOOL * KPOOL, t] of t's own pool (none when t ends a pool)
    v = tl.arange(0, KPOOL)
    j = (t + 1) // KPOOL * KPOOL + v
    ok = j <= t
    page = tl.load(table_ptr + s * stride_ts + (j // page_rows) * stride_tp, mask=ok, other=0)
    crow = page.to(tl.int64) * page_rows + j % page_rows
    c = tl.load(
        c_ptr + crow[:, None] * stride_cn + d[None, :], mask=ok[:, None] & dok[None, :], other=0.0
    )
    cs = tl.zeros((KPOOL,), dtype=tl.float32)
    if SCALED:
        cs = tl.load(cs_ptr + crow * stride_csn, mask=ok, other=0.0)
    m_i, l_i, acc = _attend(q, c, cs, ok, m_i, l_i, acc, scale, SCALED, IEEE, INTERP)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + row * stride_on + h[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=hok[:, None] & dok[None, :],
    )


def sparse_mla(
    q_lat: torch.Tensor,
    latent: torch.Tensor,
    selection: torch.Tensor,
    positions: torch.Tensor,
    meta: PassMeta,
    page_rows: int,
    kpool: int,
    scale: float,
    latent_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_lat [N, heads, r] (model dtype); latent [P*R, r] (the flat paged buffer, holding this
    pass's rows); selection [N, W] int32 chosen pools, ascending, -1 padded (triton_indexer);
    positions [N]; latent_scales [P*R, 1] when the latent rows are fp8. Returns [N, heads, r]
    in q_lat's dtype (the softmax and sums in fp32)."""
    n, heads, r = q_lat.shape
    out = torch.empty_like(q_lat)
    if n == 0:
        return out
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    n_sel = selection.shape[1]
    hb = min(HEADS_BLOCK, next_power_of_2(heads))
    scaled = latent_scales is not None
    cs = latent_scales if scaled else latent  # unread unless scaled
    _sparse_mla_kernel[(n, cdiv(heads, hb))](
        q_lat,
        latent,
        cs,
        out,
        selection,
        positions,
        meta.row_stream,
        meta.table,
        meta.table.stride(0),
        meta.table.stride(1),
        page_rows,
        n_sel,
        scale,
        q_lat.stride(0),
        q_lat.stride(1),
        latent.stride(0),
        cs.stride(0),
        out.stride(0),
        out.stride(1),
        selection.stride(0),
        HEADS=heads,
        HB=hb,
        R=r,
        RP=next_power_of_2(r),
        KPOOL=kpool,
        PPS=POOLS_PER_STEP,
        SELP=next_power_of_2(max(n_sel, 1)),
        SCALED=scaled,
        IEEE=q_lat.dtype == torch.float32,
        INTERP=interpreting(),
        num_warps=4,
        **launch_options(q_lat),
    )
    return out
