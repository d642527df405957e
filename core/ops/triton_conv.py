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
from .triton_linear import _chunk_product
from .triton_norms import norm_rows
from .triton_util import after_prior, interpreting

ROWS = 16
CHANNELS = 128
TAIL_IN_PLACE = True  # a decode round's tails moved on by the conv's own launch (False: a second)
# norm_proj_conv: a decode round's in_proj and conv in one launch (lfm2's conv layers). Off
# until the GPU shows its bits equal the launches it replaces (tests/test_gpu_kernels.py)
PROJ_IN_CONV = False
PROJ_CONV_BLOCK_N = 16  # channels a program computes (each of B, C and x: 3x the rows)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _gated_conv_kernel(
    bcx_ptr, state_ptr, w_ptr, bias_ptr, y_ptr, row_stream, stream_row0, stream_start,
    stream_slot, n_rows, H, stride_bcx, stride_ss,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, CH: tl.constexpr,
    ONE_ROW_EACH: tl.constexpr = False, PDL: tl.constexpr = False,
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
        ub = tl.load(bcx_ptr + src.to(tl.int64)[:, None] * stride_bcx + ch[None, :], mask=m_u, other=0.0)
        ux = tl.load(bcx_ptr + src.to(tl.int64)[:, None] * stride_bcx + 2 * H + ch[None, :], mask=m_u, other=0.0)
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
                tl.store(t_ptrs - 1, tap.to(state_ptr.dtype.element_ty),
                         mask=rmask[:, None] & cmask[None, :])
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    z = acc.to(dt).to(tl.float32)
    m = rmask[:, None] & cmask[None, :]
    c = tl.load(bcx_ptr + rows.to(tl.int64)[:, None] * stride_bcx + H + ch[None, :], mask=m, other=0.0)
    y = (c.to(tl.float32) * z).to(dt)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + ch[None, :], y, mask=m)


@triton.jit
def tail_kernel(
    bcx_ptr, state_ptr, stream_row0, stream_len, stream_start, stream_slot, H, stride_bcx,
    stride_ss, K: tl.constexpr, KP: tl.constexpr, CH: tl.constexpr, GATED: tl.constexpr = True,
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
        ux = tl.load(bcx_ptr + src[None, :] * stride_bcx + 2 * H + ch[:, None], mask=m_u,
                     other=0.0)
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
    grid = (triton.cdiv(n, ROWS), triton.cdiv(h, CHANNELS))
    in_place = one_row_each and TAIL_IN_PLACE and k >= 2 and state.dtype == bcx.dtype
    _gated_conv_kernel[grid](
        bcx, state, weight, bias if bias is not None else weight, y, meta.row_stream,
        meta.stream_row0, meta.stream_start, meta.stream_slot, n, h, bcx.stride(0),
        state.stride(0), K=k, HAS_BIAS=bias is not None, ROWS=ROWS, CH=CHANNELS,
        ONE_ROW_EACH=in_place, num_warps=4, **launch_options(bcx),
    )
    if in_place:
        return y
    tail_kernel[(meta.num_streams, triton.cdiv(h, CHANNELS))](
        bcx, state, meta.stream_row0, meta.stream_len, meta.stream_start, meta.stream_slot, h,
        bcx.stride(0), state.stride(0), K=k, KP=triton.next_power_of_2(max(k - 1, 1)),
        CH=CHANNELS, num_warps=4, **launch_options(bcx),
    )
    return y


@triton.jit
def _proj_rows(
    x_ptr, w_ptr, ib_ptr, part, rm, ch, M, H, K, CHUNK, stride_xm, stride_wn, dt: tl.constexpr,
    HAS_IN_BIAS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Channels ch of part `part` (0: B, 1: C, 2: x) of in_proj's output for rows rm, rounded
    to dt, as _linear_kernel computes them: its chunks in order, then the bias."""
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.static_range(SPLITS):
        total += _chunk_product(
            x_ptr, w_ptr + part * H * stride_wn, rm, ch, M, H, t * CHUNK,
            tl.minimum(K, (t + 1) * CHUNK), stride_xm, stride_wn, IEEE, INTERP, BLOCK_M, BLOCK_N,
            BLOCK_K,
        )
    out = total.to(dt)
    if HAS_IN_BIAS:
        ib = tl.load(ib_ptr + part * H + ch, mask=ch < H, other=0.0)
        out = (out.to(tl.float32) + ib.to(tl.float32)).to(dt)
    return out


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _proj_conv_kernel(
    x_ptr, w_ptr, ib_ptr, state_ptr, cw_ptr, cb_ptr, y_ptr, row_stream, stream_start,
    stream_slot, M, H, K, CHUNK, stride_xm, stride_wn, stride_ss,
    HAS_IN_BIAS: tl.constexpr, HAS_BIAS: tl.constexpr, TAPS: tl.constexpr, IEEE: tl.constexpr,
    INTERP: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
    yn_ptr=None, r_ptr=None, nw_ptr=None, h_ptr=None, in_eps=0.0, NORM_IN: tl.constexpr = False,
    HAS_RES: tl.constexpr = False, NROWS: tl.constexpr = 1, BLOCK_D: tl.constexpr = 16,
    SLOTS: tl.constexpr = 1,
):
    """A decode round's in_proj and gated conv in one launch (each stream one row, M <= BLOCK_M):
    the program's BLOCK_N channels of B, C and x, each as triton_linear's _linear_kernel sums
    it (_chunk_product over the same chunks, so the same bits), then the conv of those channels
    as _gated_conv_kernel's ONE_ROW_EACH computes it, tails moved on in place. NORM_IN (one
    row): x = rms_norm(y (+ r)) first, as triton_linear's NORM_IN."""
    after_prior(PDL)
    if NORM_IN:
        norm_rows(yn_ptr, r_ptr, nw_ptr, x_ptr, h_ptr, 0, 1, K, in_eps, HAS_RES, NROWS, BLOCK_D,
                  SLOTS)
        tl.debug_barrier()  # the program's stores of x seen by all its threads before it reads x
    rm = tl.arange(0, BLOCK_M)
    ch = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dt = y_ptr.dtype.element_ty
    ob = _proj_rows(x_ptr, w_ptr, ib_ptr, 0, rm, ch, M, H, K, CHUNK, stride_xm, stride_wn, dt,
                    HAS_IN_BIAS, IEEE, INTERP, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)
    oc = _proj_rows(x_ptr, w_ptr, ib_ptr, 1, rm, ch, M, H, K, CHUNK, stride_xm, stride_wn, dt,
                    HAS_IN_BIAS, IEEE, INTERP, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)
    ox = _proj_rows(x_ptr, w_ptr, ib_ptr, 2, rm, ch, M, H, K, CHUNK, stride_xm, stride_wn, dt,
                    HAS_IN_BIAS, IEEE, INTERP, SPLITS, BLOCK_M, BLOCK_N, BLOCK_K)
    rmask = rm < M
    cmask = ch < H
    m = rmask[:, None] & cmask[None, :]
    s = tl.load(row_stream + rm, mask=rmask, other=0)
    fresh = tl.load(stream_start + s, mask=rmask, other=0) == 0
    slot = tl.load(stream_slot + s, mask=rmask, other=0).to(tl.int64)
    u = (ob.to(tl.float32) * ox.to(tl.float32)).to(dt).to(tl.float32)
    t_ptrs = state_ptr + slot[:, None] * stride_ss + ch[None, :] * (TAPS - 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(TAPS):
        if j < TAPS - 1:
            tap = tl.load(t_ptrs + j, mask=m & ~fresh[:, None], other=0.0).to(tl.float32)
        else:
            tap = u
        w = tl.load(cw_ptr + ch * TAPS + j, mask=cmask, other=0.0).to(tl.float32)
        if j == 0:
            acc = tap * w[None, :]
        else:
            acc = acc + tap * w[None, :]
            tl.debug_barrier()  # tap j-1's slot read by every thread before it is overwritten
            tl.store(t_ptrs + (j - 1), tap.to(state_ptr.dtype.element_ty), mask=m)
    if HAS_BIAS:
        acc = acc + tl.load(cb_ptr + ch, mask=cmask, other=0.0).to(tl.float32)[None, :]
    z = acc.to(dt).to(tl.float32)
    y = (oc.to(tl.float32) * z).to(dt)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * H + ch[None, :], y, mask=m)


def norm_proj_conv(
    y: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    in_proj: torch.Tensor, in_bias: torch.Tensor | None, state: torch.Tensor, meta: PassMeta,
    weight: torch.Tensor, bias: torch.Tensor | None, slots: int = 1,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode round's h = y + residual (y alone without one; y [N, slots, D] summed first),
    x = rms_norm(h), bcx = linear(x, in_proj, in_bias) and gated_conv(bcx, state, ...,
    one_row_each=True) with the bits of those launches: (C ⊙ conv(B ⊙ x) [N, H], h), in one
    launch for a pass of one row (two for a few rows: the norm's own, then this one). None
    where it does not apply (PROJ_IN_CONV off, more than triton_linear.TINY_ROWS rows, a tail
    kept in another dtype, or tiles not in the norm's warps)."""
    from . import triton_linear as lin
    from .triton_norms import NORM_WARPS, add_rms_norm, rms_norm, rows_per_program

    d = y.shape[-1]
    n = y.numel() // (slots * d)
    h3, k = in_proj.shape
    hc, taps = weight.shape
    dt = y.dtype
    tiles = lin.tiles_for(h3, k)
    if not (PROJ_IN_CONV and 0 < n <= lin.TINY_ROWS and h3 == 3 * hc and k == d and taps >= 2
            and state.dtype == dt == in_proj.dtype and in_proj.stride(-1) == 1
            and tiles.warps == NORM_WARPS and meta.num_streams == n):
        return None
    if lin.fuses_norm(n, y, residual, norm_weight, in_proj, slots):
        y = y.contiguous()
        x = torch.empty(1, d, dtype=dt, device=y.device)
        h = torch.empty_like(x) if residual is not None else y.view(1, d)
        rows, block_d = rows_per_program(d)
        norm_in = dict(yn_ptr=y, r_ptr=residual.contiguous() if residual is not None else y,
                       nw_ptr=norm_weight.contiguous(), h_ptr=h, in_eps=float(eps), NORM_IN=True,
                       HAS_RES=residual is not None, NROWS=rows, BLOCK_D=block_d, SLOTS=slots)
    else:
        if residual is None:
            x, h = rms_norm(y, norm_weight, eps), y
        else:
            x, h = add_rms_norm(y, residual, norm_weight, eps, slots)
        x, norm_in = x.reshape(n, d).contiguous(), {}
    splits = lin.splits_of(h3, k)
    out = torch.empty(n, hc, dtype=dt, device=y.device)
    _proj_conv_kernel[(triton.cdiv(hc, PROJ_CONV_BLOCK_N),)](
        x, in_proj, in_bias if in_bias is not None else in_proj, state, weight.contiguous(),
        bias if bias is not None else weight, out, meta.row_stream, meta.stream_start,
        meta.stream_slot, n, hc, k, lin.splitk.chunk(k, tiles.block_k, splits), x.stride(0),
        in_proj.stride(0), state.stride(0),
        HAS_IN_BIAS=in_bias is not None, HAS_BIAS=bias is not None, TAPS=taps,
        IEEE=dt == torch.float32, INTERP=interpreting(), SPLITS=splits,
        BLOCK_M=lin.TINY_BLOCK_M, BLOCK_N=PROJ_CONV_BLOCK_N, BLOCK_K=tiles.block_k,
        num_warps=tiles.warps, num_stages=tiles.stages, **launch_options(x), **norm_in,
    )
    return out, h
