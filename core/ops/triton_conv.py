"""The gated short convolution of a whole pass on the GPU in Triton: y = C ⊙ conv(B ⊙ x), with
each stream's tail read from and written back to its fixed-state slot.

Output t of a run is Σ_j w[:, j] · ext[t + j] over ext = tail ++ u (u = B ⊙ x rounded to the
model dtype), taps in order, fp32, bias last, rounded; then C ⊙ z rounded, as ops/conv.py. Every
output is elementwise in its own K inputs. The tails are updated by a second launch, after every
output has read the old ones; in a pass of one row a stream (a decode round) the row's own program
moves its stream's tail on as it reads it, in the same launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .pass_meta import PassMeta
from .triton_util import after_prior, cdiv, next_power_of_2

ROWS = 16
CHANNELS = 128


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _gated_conv_kernel(
    bcx_ptr,
    state_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    row_stream,
    stream_row0,
    stream_start,
    stream_slot,
    n_rows,
    H,
    stride_bcx,
    stride_ss,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,
    CH: tl.constexpr,
    ONE_ROW_EACH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ch = tl.program_id(1) * CH + tl.arange(0, CH)
    rmask = rows < n_rows
    cmask = ch < H
    s = tl.load(row_stream + rows, mask=rmask, other=0)
    local = rows - tl.load(stream_row0 + s, mask=rmask, other=0)
    fresh = tl.load(stream_start + s, mask=rmask, other=0) == 0
    slot = tl.load(stream_slot + s, mask=rmask, other=0).to(tl.int64)
    dt = y_ptr.dtype.element_ty
    acc = tl.zeros((ROWS, CH), dtype=tl.float32)
    for j in tl.static_range(K):
        e = local + j  # index into ext = tail (K-1 columns) ++ u
        from_u = e >= K - 1
        src = rows + j - (K - 1)
        m_u = (rmask & from_u)[:, None] & cmask[None, :]
        ub = tl.load(
            bcx_ptr + src.to(tl.int64)[:, None] * stride_bcx + ch[None, :], mask=m_u, other=0.0
        )
        ux = tl.load(
            bcx_ptr + src.to(tl.int64)[:, None] * stride_bcx + 2 * H + ch[None, :],
            mask=m_u,
            other=0.0,
        )
        u = (ub.to(tl.float32) * ux.to(tl.float32)).to(dt).to(tl.float32)
        m_t = (rmask & ~from_u & ~fresh)[:, None] & cmask[None, :]
        t_ptrs = state_ptr + slot[:, None] * stride_ss + ch[None, :] * (K - 1) + e[:, None]
        tail = tl.load(t_ptrs, mask=m_t, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ch * K + j, mask=cmask, other=0.0).to(tl.float32)
        tap = tl.where(from_u[:, None], u, tail)
        if j == 0:
            acc = tap * w[None, :]
        else:
            acc = acc + tap * w[None, :]
            if ONE_ROW_EACH:  # the row is its stream's run (e == j): tap j is the new tail's j-1,
                # stored where tap j-1 was read (read by every thread before the barrier); the
                # state's dtype is the model's, so the tap is the value tail_kernel would store
                tl.debug_barrier()
                tl.store(
                    t_ptrs - 1,
                    tap.to(state_ptr.dtype.element_ty),
                    mask=rmask[:, None] & cmask[None, :],
                )
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    z = acc.to(dt).to(tl.float32)
    m = rmask[:, None] & cmask[None, :]
    c = tl.load(
        bcx_ptr + rows.to(tl.int64)[:, None] * stride_bcx + H + ch[None, :], mask=m, other=0.0
    )
    y = (c.to(tl.float32) * z).to(dt)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + ch[None, :], y, mask=m)


@triton.jit
def tail_kernel(
    bcx_ptr,
    state_ptr,
    stream_row0,
    stream_len,
    stream_start,
    stream_slot,
    H,
    stride_bcx,
    stride_ss,
    K: tl.constexpr,
    KP: tl.constexpr,
    CH: tl.constexpr,
    GATED: tl.constexpr = True,
    PDL: tl.constexpr = False,
):
    """Each stream's conv tail [H, K-1] in its slot moved on past its run: the last K-1 inputs,
    from the run's rows and, for a run shorter than K-1, the old tail (zeros for a fresh
    stream). GATED: an input is B ⊙ x of the row's [B | C | x] (lfm2's gated conv), rounded to
    the tail's dtype; otherwise the row's own H channels (glm5_next's KDA conv)."""
    after_prior(PDL)
    s = tl.program_id(0)
    ch = tl.program_id(1) * CH + tl.arange(0, CH)
    cmask = ch < H
    row0 = tl.load(stream_row0 + s)
    n = tl.load(stream_len + s)
    fresh = tl.load(stream_start + s) == 0
    slot = tl.load(stream_slot + s).to(tl.int64)
    j = tl.arange(0, KP)
    jmask = j < K - 1
    e = n + j  # the new tail is ext[n : n + K - 1]
    from_u = e >= K - 1
    src = (row0 + e - (K - 1)).to(tl.int64)
    m_u = (jmask & from_u)[None, :] & cmask[:, None]
    dt = state_ptr.dtype.element_ty
    ub = tl.load(bcx_ptr + src[None, :] * stride_bcx + ch[:, None], mask=m_u, other=0.0)
    if GATED:
        ux = tl.load(bcx_ptr + src[None, :] * stride_bcx + 2 * H + ch[:, None], mask=m_u, other=0.0)
        u = (ub.to(tl.float32) * ux.to(tl.float32)).to(dt)
    else:
        u = ub.to(dt)
    t_ptrs = state_ptr + slot * stride_ss + ch[:, None] * (K - 1)
    m_t = (jmask & ~from_u & ~fresh)[None, :] & cmask[:, None]
    old = tl.load(t_ptrs + e[None, :], mask=m_t, other=0.0)
    new = tl.where(from_u[None, :], u, old)
    tl.store(t_ptrs + j[None, :], new, mask=jmask[None, :] & cmask[:, None])


def gated_conv(
    bcx: torch.Tensor,
    state: torch.Tensor,
    meta: PassMeta,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    one_row_each: bool = False,
) -> torch.Tensor:
    """bcx [N, 3H] (B, C, x); state [slots, H, K-1] (updated in place); weight [H, K]; bias [H].
    one_row_each: every stream of the pass has one row (a decode round). Returns C ⊙ conv(B ⊙ x)
    [N, H]."""
    n = bcx.shape[0]
    h, k = weight.shape
    bcx = bcx.contiguous()
    weight = weight.contiguous()
    y = torch.empty(n, h, dtype=bcx.dtype, device=bcx.device)
    if n == 0:
        return y
    grid = (cdiv(n, ROWS), cdiv(h, CHANNELS))
    in_place = one_row_each and k >= 2 and state.dtype == bcx.dtype
    _gated_conv_kernel[grid](
        bcx,
        state,
        weight,
        bias if bias is not None else weight,
        y,
        meta.row_stream,
        meta.stream_row0,
        meta.stream_start,
        meta.stream_slot,
        n,
        h,
        bcx.stride(0),
        state.stride(0),
        K=k,
        HAS_BIAS=bias is not None,
        ROWS=ROWS,
        CH=CHANNELS,
        ONE_ROW_EACH=in_place,
        num_warps=4,
        **launch_options(bcx),
    )
    if in_place:
        return y
    tail_kernel[(meta.num_streams, cdiv(h, CHANNELS))](
        bcx,
        state,
        meta.stream_row0,
        meta.stream_len,
        meta.stream_start,
        meta.stream_slot,
        h,
        bcx.stride(0),
        state.stride(0),
        K=k,
        KP=next_power_of_2(max(k - 1, 1)),
        CH=CHANNELS,
        num_warps=4,
        **launch_options(bcx),
    )
    return y
