"""Sliding-window attention over per-stream rings on the GPU in Triton, and the rings' advance,
as ops/window_attention.py computes them (graph-capturable: the layout is PassMeta's).

A stream's ring [W-1, Hkv, D] holds row p at index p mod (W-1). A pass's run of a stream over
[start, start + len) reads positions [max(0, start-W+1), start) from its ring and positions
>= start from the pass's new rows. The attention kernel is the paged kernel's walk
(triton_attention.py: the same row tiles, key tiles aligned to absolute positions, fixed
head-dim chunks, the same key segments and online softmax) with keys read from those two
places; ring rows outside the window (stale, or NaN in a poisoned slot) are never loaded. So
its bits equal the paged kernel's with the same window over the same rows.

Media blocks (`upto`, the pass's attend_upto): a query at t sees keys t-window < j <= upto[t],
so a row inside an image block sees the block's later rows (new rows of its run); a row tile's
key tiles reach its rows' largest upto, and segment slots (`reach`) cover it.

Attention must read the rings before they advance: the new row at p overwrites p-(W-1), which
the query at p still sees. fp8 rings (SCALED): the new rows and the rings are e4m3, their
scales read from the same two places (window_attention.RingScales).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_key_split as key_split
from .gpu import launch_options
from .pass_meta import QUERY_ROWS, PassMeta
from .triton_attention import KEY_TILE, attend_tile, row_tile, scaled_q, tile_keywords, tiles
from .triton_util import after_prior, cdiv, next_power_of_2


@triton.jit(do_not_specialize=["window", "parts", "nseg"])
def _ring_attention_kernel(
    q_ptr,
    nk_ptr,
    nv_ptr,
    rk_ptr,
    rv_ptr,
    nks_ptr,
    nvs_ptr,
    rks_ptr,
    rvs_ptr,
    o_ptr,
    pos_ptr,
    block_stream,
    block_row0,
    block_len,
    stream_row0,
    stream_start,
    stream_slot,
    scale,
    window,
    stride_qn,
    stride_qh,
    stride_nkn,
    stride_nkh,
    stride_nvn,
    stride_nvh,
    stride_rks,
    stride_rkr,
    stride_rkh,
    stride_rvs,
    stride_rvr,
    stride_rvh,
    stride_on,
    stride_oh,
    stride_sn,
    stride_sh,
    stride_ss,
    stride_sr,
    G: tl.constexpr,
    GP: tl.constexpr,
    QB: tl.constexpr,
    NSUB: tl.constexpr,
    D: tl.constexpr,
    DC: tl.constexpr,
    BDV: tl.constexpr,
    KT: tl.constexpr,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    ws_ptr=None,
    ml_ptr=None,
    parts=1,
    HQ: tl.constexpr = 1,
    nseg=1,
    DVB: tl.constexpr = 1,
    SEG: tl.constexpr = 256,
    SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
    up_ptr=None,
    HAS_UP: tl.constexpr = False,
):
    after_prior(PDL)
    kvh = tl.program_id(1)
    dv0 = (tl.program_id(2) % DVB) * BDV
    part = tl.program_id(2) // DVB
    blk, qrow, head, valid, qpos, first, hi = row_tile(
        pos_ptr, block_row0, block_len, tl.program_id(0), kvh, G, GP, QB, NSUB
    )
    qup = qpos  # the last key each row sees
    if HAS_UP:
        qup = tl.load(up_ptr + qrow, mask=valid, other=0).to(tl.int32)
        hi = tl.max(tl.where(valid, qup, -1), axis=0) + 1  # 0 when the part is empty
    s = tl.load(block_stream + blk)
    start = tl.load(stream_start + s).to(tl.int32)
    srow0 = tl.load(stream_row0 + s).to(tl.int32)
    slot = tl.load(stream_slot + s).to(tl.int64)
    rows = tl.maximum(window - 1, 1)  # ring rows (a window of 1 reads none)
    ring_lo = tl.maximum(start - window + 1, 0)  # the ring holds positions [ring_lo, start)
    q_off = qrow * stride_qn + head * stride_qh
    q0 = scaled_q(
        tl.load(q_ptr + q_off[:, None] + tl.arange(0, DC)[None, :], mask=valid[:, None], other=0.0),
        SCALED,
        IEEE,
    )
    lo = (tl.maximum(first - window + 1, 0) // KT) * KT
    kt = tl.arange(0, KT)
    m_t, l_t, acc_t = key_split.fresh(QB * GP, BDV)
    step = parts if SPLIT else 1
    for seg in range(lo // SEG + part, tl.cdiv(hi, SEG), step):
        m_i, l_i, acc = key_split.fresh(QB * GP, BDV)
        for t0 in range(tl.maximum(lo, seg * SEG), tl.minimum(hi, seg * SEG + SEG), KT):
            j = t0 + kt
            in_ring = (j >= ring_lo) & (j < start)
            in_new = (j >= start) & (j < hi)  # rows of this run up to the tile's last query
            ring_at = (slot * stride_rks + (j % rows) * stride_rkr).to(tl.int64)
            new_at = (srow0 + j - start).to(tl.int64)
            k_row = tl.where(
                in_ring,
                rk_ptr + ring_at + kvh * stride_rkh,
                nk_ptr + new_at * stride_nkn + kvh * stride_nkh,
            )
            ring_at_v = (slot * stride_rvs + (j % rows) * stride_rvr).to(tl.int64)
            v_row = tl.where(
                in_ring,
                rv_ptr + ring_at_v + kvh * stride_rvh,
                nv_ptr + new_at * stride_nvn + kvh * stride_nvh,
            )
            # the scales' offsets (new [N, Hkv, 1] and rings [slots, W-1, Hkv, 1] alike strided)
            s_at = (
                tl.where(in_ring, slot * stride_ss + (j % rows) * stride_sr, new_at * stride_sn)
                + kvh * stride_sh
            )
            ks_row = tl.where(in_ring, rks_ptr + s_at, nks_ptr + s_at)
            vs_row = tl.where(in_ring, rvs_ptr + s_at, nvs_ptr + s_at)
            visible = (j[None, :] <= qup[:, None]) & (j[None, :] > qpos[:, None] - window)
            m_i, l_i, acc = attend_tile(
                q_ptr,
                q_off,
                q0,
                valid,
                k_row,
                v_row,
                ks_row,
                vs_row,
                in_ring | in_new,
                visible,
                m_i,
                l_i,
                acc,
                scale,
                QB * GP,
                KT,
                D,
                DC,
                BDV,
                dv0,
                SCALED,
                IEEE,
                INTERP,
            )
        m_t, l_t, acc_t = key_split.end_segment(
            m_t,
            l_t,
            acc_t,
            m_i,
            l_i,
            acc,
            ws_ptr,
            ml_ptr,
            qrow,
            head,
            valid,
            seg,
            dv0,
            nseg,
            HQ,
            DVB * BDV,
            BDV,
            SPLIT,
        )
    key_split.store_total(
        o_ptr, qrow, head, valid, l_t, acc_t, dv0, stride_on, stride_oh, BDV, SPLIT
    )


def ring_attention(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    positions: torch.Tensor,
    meta: PassMeta,
    *,
    scale: float,
    window: int,
    scales=None,
    parts: int | None = None,
    upto: torch.Tensor | None = None,
    reach: int = 0,
) -> torch.Tensor:
    """q [N, Hq, D]; new_k [N, Hkv, D], new_v [N, Hkv, Dv]: the pass's rows; ring_k
    [slots, W-1, Hkv, D], ring_v [slots, W-1, Hkv, Dv]: the rings before the pass; positions
    [N]; scales: a window_attention.RingScales when the rows are fp8. A query at t sees keys
    t-window < j <= t of its stream; with upto [N] (media blocks) t-window < j <= upto[t], where
    upto[t] - t <= reach (window_attention.block_reach). Returns [N, Hq, Dv] in q's dtype."""
    n, hq, d = q.shape
    hkv, dv = new_k.shape[1], new_v.shape[-1]
    out = torch.empty(n, hq, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    new_k, new_v = (x if x.stride(-1) == 1 else x.contiguous() for x in (new_k, new_v))
    assert ring_k.stride(-1) == 1 and ring_v.stride(-1) == 1
    group = hq // hkv
    qb, dc, bdv = tiles(d, dv, group, scales is not None)
    nsub = QUERY_ROWS // qb
    if scales is not None:
        nks, nvs, rks, rvs = (x.contiguous() for x in scales)
        assert nks.shape == nvs.shape and rks.shape == rvs.shape
        s_strides = (nks.stride(0), nks.stride(1), rks.stride(0), rks.stride(1))
        assert s_strides[1] == rks.stride(2), "new and ring scales share the head stride"
    else:  # unread
        nks, nvs, rks, rvs, s_strides = new_k, new_v, ring_k, ring_v, (0, 0, 0, 0)
    dvb = dv // bdv
    nseg = cdiv(window + KEY_TILE + QUERY_ROWS + reach, key_split.SEGMENT) + 1
    blocks = {} if upto is None else dict(up_ptr=upto, HAS_UP=True)
    split = key_split.plan(
        q, out, key_split.live_tiles(meta.num_blocks, nsub, n, qb), hkv, dvb, nseg, parts
    )
    _ring_attention_kernel[(meta.num_blocks * nsub, hkv, dvb * split.parts)](
        q,
        new_k,
        new_v,
        ring_k,
        ring_v,
        nks,
        nvs,
        rks,
        rvs,
        out,
        positions,
        meta.block_stream,
        meta.block_row0,
        meta.block_len,
        meta.stream_row0,
        meta.stream_start,
        meta.stream_slot,
        scale,
        window,
        q.stride(0),
        q.stride(1),
        new_k.stride(0),
        new_k.stride(1),
        new_v.stride(0),
        new_v.stride(1),
        ring_k.stride(0),
        ring_k.stride(1),
        ring_k.stride(2),
        ring_v.stride(0),
        ring_v.stride(1),
        ring_v.stride(2),
        out.stride(0),
        out.stride(1),
        *s_strides,
        **tile_keywords(q, dv, group, qb, dc, bdv, scales is not None),
        **split.kernel,
        **blocks,
        **launch_options(q),
    )
    split.finish(out, positions, window, bdv, upto)
    return out


@triton.jit
def _advance_one(
    new_ptr,
    ring_ptr,
    i,
    h,
    p,
    keep,
    slot,
    rows,
    stride_nn,
    stride_nh,
    stride_rs,
    stride_rr,
    stride_rh,
    D: tl.constexpr,
    BD: tl.constexpr,
):
    """Head h of the pass's row i (at position p) to ring[slot, p mod rows] where keep."""
    dst = ring_ptr + slot * stride_rs + (p % rows).to(tl.int64) * stride_rr + h * stride_rh
    src = new_ptr + i.to(tl.int64) * stride_nn + h * stride_nh
    for c in tl.static_range(0, D, BD):
        cols = c + tl.arange(0, BD)
        x = tl.load(src + cols, mask=keep & (cols < D), other=0.0)
        tl.store(dst + cols, x, mask=keep & (cols < D))


@triton.jit
def _advance_kernel(
    pos_ptr,
    row_stream,
    stream_start,
    stream_len,
    stream_slot,
    rows,
    n0,
    r0,
    n0n,
    n0h,
    r0s,
    r0r,
    r0h,
    n1,
    r1,
    n1n,
    n1h,
    r1s,
    r1r,
    r1h,
    n2,
    r2,
    n2n,
    n2h,
    r2s,
    r2r,
    r2h,
    n3,
    r3,
    n3n,
    n3h,
    r3s,
    r3r,
    r3h,
    H0: tl.constexpr,
    H1: tl.constexpr,
    H2: tl.constexpr,
    D0: tl.constexpr,
    D1: tl.constexpr,
    D2: tl.constexpr,
    D3: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Up to four rings (same slots and rows) advanced by their new rows: program (i, j) moves
    row i's head j of the rings' heads laid end to end (H0 of the first, H1, ...)."""
    after_prior(PDL)
    i = tl.program_id(0)
    j = tl.program_id(1)
    s = tl.load(row_stream + i)
    p = tl.load(pos_ptr + i).to(tl.int32)
    end = (tl.load(stream_start + s) + tl.load(stream_len + s)).to(tl.int32)
    slot = tl.load(stream_slot + s).to(tl.int64)
    keep = p >= end - rows  # the stream's last `rows` rows of this pass
    if j < H0:
        _advance_one(n0, r0, i, j, p, keep, slot, rows, n0n, n0h, r0s, r0r, r0h, D0, BD)
    elif j < H0 + H1:
        _advance_one(n1, r1, i, j - H0, p, keep, slot, rows, n1n, n1h, r1s, r1r, r1h, D1, BD)
    elif j < H0 + H1 + H2:
        _advance_one(n2, r2, i, j - H0 - H1, p, keep, slot, rows, n2n, n2h, r2s, r2r, r2h, D2, BD)
    else:
        _advance_one(
            n3, r3, i, j - H0 - H1 - H2, p, keep, slot, rows, n3n, n3h, r3s, r3r, r3h, D3, BD
        )


def advance_rings(
    ring: torch.Tensor, new: torch.Tensor, positions: torch.Tensor, meta: PassMeta
) -> None:
    """ring [slots, W-1, Hkv, D]; new [N, Hkv, D]: the pass's rows at positions [N]. Each
    stream's last min(len, W-1) rows go to ring[slot, pos mod (W-1)]."""
    advance_many([ring], [new], positions, meta)


def advance_many(
    rings: list[torch.Tensor], news: list[torch.Tensor], positions: torch.Tensor, meta: PassMeta
) -> None:
    """advance_rings of each (ring, new) pair, in one launch for each four (a sliding layer's
    K and V rings, and their fp8 scales'). The rings share their slots and rows (W-1)."""
    for a in range(0, len(rings), 4):
        _advance_group(rings[a : a + 4], news[a : a + 4], positions, meta)


def _advance_group(rings, news, positions, meta) -> None:
    rows = rings[0].shape[1]
    n = news[0].shape[0]
    if rows == 0 or n == 0:
        return
    args, heads, dims = [], [], []
    for ring, new in zip(rings, news):
        assert ring.shape[1] == rows and new.shape[0] == n and ring.stride(-1) == 1
        new = new.reshape(n, -1, new.shape[-1])
        if new.stride(-1) != 1:
            new = new.contiguous()
        ring = ring.view(ring.shape[0], rows, -1, ring.shape[-1])
        args += [
            new,
            ring,
            new.stride(0),
            new.stride(1),
            ring.stride(0),
            ring.stride(1),
            ring.stride(2),
        ]
        heads.append(new.shape[1])
        dims.append(new.shape[2])
    while len(heads) < 4:  # unused pairs: no program reaches them
        args += args[:7]
        heads.append(0)
        dims.append(dims[0])
    _advance_kernel[(n, sum(heads))](
        positions,
        meta.row_stream,
        meta.stream_start,
        meta.stream_len,
        meta.stream_slot,
        rows,
        *args,
        H0=heads[0],
        H1=heads[1],
        H2=heads[2],
        D0=dims[0],
        D1=dims[1],
        D2=dims[2],
        D3=dims[3],
        BD=min(next_power_of_2(max(dims)), 256),
        num_warps=4,
        **launch_options(news[0]),
    )
