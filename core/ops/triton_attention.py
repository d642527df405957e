"""Causal attention of a pass over paged K/V on the GPU in Triton (prompt rows and decode rows
together, GQA), as ops/attention.py computes it.

A program takes QB consecutive rows of one query block of the pass (times the G query heads that
share a KV head: an [M = QB*GP] row tile), one KV head and one block of BDV output columns, and
walks key tiles of KEY_TILE aligned to absolute positions, from the first its rows can see to the
last, with an online softmax in fp32. Scores sum the head dim in chunks of DC in a fixed order;
every output block recomputes the same scores, so its softmax statistics are the same bits. A
tile a row cannot see is an exact no-op for it, so a row's result depends only on its position
and its stream's keys, never on where the pass cut the prompt or what else is in the pass. The
tile sizes depend only on (D, DV, G), never on the pass (`tiles`). Keys are read through the
stream's page table; rows past what the stream has written are never loaded.

`attend_tile` is shared with the ring kernel (triton_window.py), which reads its keys elsewhere.

Keys come in segments of triton_key_split.SEGMENT: each segment's online softmax starts fresh
and the segments fold into the row's total in order (triton_key_split.merge), either as one
program walks them or, for passes with few programs (a few decode rows over a long context),
shared among `parts` programs and folded by a second kernel: the same bits either way.

fp8 rows (SCALED): keys and values are e4m3, converted exactly to fp16 (one instruction for two
on sm_90; bf16 takes three: docs/performance.md, "FP8_AS_FP16"), and a
bf16 q meets them as fp16 (exact for |q| in fp16's normal range; clamped to its finite range);
an fp32 q meets them as fp32. A key's scale multiplies its scores after the head-dim sums, a
value's its probabilities before the sum over keys (tensorfold.ops.kv_quant), as the torch
reference does.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from . import triton_key_split as key_split
from .gpu import launch_options
from .pass_meta import QUERY_ROWS, PassMeta
from .triton_util import after_prior, cdiv, interpreting, mma, next_power_of_2

KEY_TILE = 64
WIDE_HEAD = 128  # head dims above this take 16-row tiles, WIDE_BDV output columns a program
WIDE_BDV = 512  # (each output block recomputes the scores; one block of 512 at 8 warps does
WIDE_WARPS = 8  # gemma4's global heads: docs/performance.md, "WIDE_BDV")


def tiles(d: int, dv: int, group: int, fp8: bool = False) -> tuple[int, int, int]:
    """(QB query rows a program, DC head-dim chunk, BDV output columns a program) for head dims
    d/dv, GQA group `group` and the rows' dtype; a function of these only, so every pass gets
    the same bits. Narrow heads take QUERY_ROWS rows a program (QB x group = 64 wgmma rows for
    lfm2), fp8 ones 16 rows (QB x group): a decode row's tile converts its e4m3 keys for 16
    rows instead of 64 (docs/performance.md, "FP8_QUERY_ROWS")."""
    gp = next_power_of_2(group)
    assert d & (d - 1) == 0 and dv & (dv - 1) == 0 and d >= 16 and dv >= 16, (d, dv)
    if max(d, dv) <= WIDE_HEAD:
        return (max(1, 16 // gp) if fp8 else QUERY_ROWS), min(d, 64), dv
    return max(1, 16 // gp), 64, min(dv, WIDE_BDV)


def warps(d: int, dv: int) -> int:
    """Warps of an attention program (paged or ring) for head dims d/dv (speed only)."""
    return key_split.WARPS if max(d, dv) <= WIDE_HEAD else WIDE_WARPS


@triton.jit
def row_tile(
    pos_ptr,
    block_row0,
    block_len,
    pid,
    kvh,
    G: tl.constexpr,
    GP: tl.constexpr,
    QB: tl.constexpr,
    NSUB: tl.constexpr,
):
    """The [QB*GP] row tile of program `pid` (query block pid // NSUB, part pid % NSUB):
    its pass rows, query heads, validity, positions, and the positions of its first and last
    rows (hi = last + 1; 0 when the part is empty, so no key tile is visited)."""
    blk = pid // NSUB
    row0 = tl.load(block_row0 + blk) + (pid % NSUB) * QB
    n = tl.load(block_len + blk) - (pid % NSUB) * QB
    m = tl.arange(0, QB * GP)
    r = m // GP
    head = kvh * G + m % GP
    valid = (r < n) & (m % GP < G)
    qrow = (row0 + r).to(tl.int64)
    qpos = tl.load(pos_ptr + qrow, mask=valid, other=0).to(tl.int32)
    has = n > 0
    first = tl.load(pos_ptr + row0, mask=has, other=0).to(tl.int32)
    hi = tl.load(pos_ptr + row0 + tl.maximum(n, 1) - 1, mask=has, other=-1).to(tl.int32) + 1
    return blk, qrow, head, valid, qpos, first, hi


@triton.jit
def scaled_q(q, SCALED: tl.constexpr, IEEE: tl.constexpr):
    """q as it meets fp8 rows: fp16 (clamped to its finite range) unless the pass is fp32."""
    if SCALED and not IEEE:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def attend_tile(
    q_ptr,
    q_off,
    q0,
    valid,
    k_row,
    v_row,
    ks_row,
    vs_row,
    kmask,
    visible,
    m_i,
    l_i,
    acc,
    scale,
    M: tl.constexpr,
    KT: tl.constexpr,
    D: tl.constexpr,
    DC: tl.constexpr,
    BDV: tl.constexpr,
    dv0,
    SCALED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One key tile's online-softmax step. q_off [M]: query row offsets (q0 [M, DC]: their first
    head-dim chunk, held); k_row, v_row [KT]: pointers to the tile's key/value rows (at the KV
    head), loaded only where kmask; ks_row, vs_row [KT]: their fp8 scales (read when SCALED);
    visible [M, KT]. Returns (m_i, l_i, acc [M, BDV])."""
    dc = tl.arange(0, DC)
    k = tl.load(k_row[:, None] + dc[None, :], mask=kmask[:, None], other=0.0)
    if SCALED:  # q0 is already scaled_q's
        k = k.to(q0.dtype)
    sc = mma(q0, tl.trans(k), tl.zeros((M, KT), dtype=tl.float32), IEEE, INTERP)
    for c in tl.static_range(DC, D, DC):  # the head dim in fixed chunks, in order
        q = tl.load(q_ptr + q_off[:, None] + (c + dc)[None, :], mask=valid[:, None], other=0.0)
        q = scaled_q(q, SCALED, IEEE)
        k = tl.load(k_row[:, None] + (c + dc)[None, :], mask=kmask[:, None], other=0.0)
        if SCALED:
            k = k.to(q0.dtype)
        sc = mma(q, tl.trans(k), sc, IEEE, INTERP)
    if SCALED:
        sc = sc * tl.load(ks_row, mask=kmask, other=0.0)[None, :]
    sc = tl.where(visible, sc * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    dv = dv0 + tl.arange(0, BDV)
    v = tl.load(v_row[:, None] + dv[None, :], mask=kmask[:, None], other=0.0)
    pv = p
    if SCALED:
        v = v.to(q0.dtype)
        pv = p * tl.load(vs_row, mask=kmask, other=0.0)[None, :]
    acc = mma(pv.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERP)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["stride_ts", "stride_tp", "window", "parts", "nseg"])  # any width
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    o_ptr,
    pos_ptr,
    block_stream,
    block_row0,
    block_len,
    stream_start,
    stream_len,
    table_ptr,
    stride_ts,
    stride_tp,
    page_rows,
    scale,
    window,
    stride_qn,
    stride_qh,
    stride_kr,
    stride_kh,
    stride_vr,
    stride_vh,
    stride_ksr,
    stride_ksh,
    stride_vsr,
    stride_vsh,
    stride_on,
    stride_oh,
    G: tl.constexpr,
    GP: tl.constexpr,
    QB: tl.constexpr,
    NSUB: tl.constexpr,
    D: tl.constexpr,
    DC: tl.constexpr,
    BDV: tl.constexpr,
    KT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
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
):
    after_prior(PDL)
    kvh = tl.program_id(1)
    dv0 = (tl.program_id(2) % DVB) * BDV
    part = tl.program_id(2) // DVB
    blk, qrow, head, valid, qpos, first, hi = row_tile(
        pos_ptr, block_row0, block_len, tl.program_id(0), kvh, G, GP, QB, NSUB
    )
    s = tl.load(block_stream + blk)
    end = tl.load(stream_start + s) + tl.load(stream_len + s)  # keys [0, end) are written
    q_off = qrow * stride_qn + head * stride_qh
    q0 = scaled_q(
        tl.load(q_ptr + q_off[:, None] + tl.arange(0, DC)[None, :], mask=valid[:, None], other=0.0),
        SCALED,
        IEEE,
    )
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(first - window + 1, 0) // KT) * KT
    kt = tl.arange(0, KT)
    m_t, l_t, acc_t = key_split.fresh(QB * GP, BDV)
    step = parts if SPLIT else 1
    for seg in range(lo // SEG + part, tl.cdiv(hi, SEG), step):
        m_i, l_i, acc = key_split.fresh(QB * GP, BDV)
        for t0 in range(tl.maximum(lo, seg * SEG), tl.minimum(hi, seg * SEG + SEG), KT):
            j = t0 + kt
            written = j < end
            page = tl.load(
                table_ptr + s * stride_ts + (j // page_rows) * stride_tp, mask=written, other=0
            )
            krow = page.to(tl.int64) * page_rows + j % page_rows
            visible = j[None, :] <= qpos[:, None]
            if HAS_WINDOW:
                visible = visible & (j[None, :] > qpos[:, None] - window)
            m_i, l_i, acc = attend_tile(
                q_ptr,
                q_off,
                q0,
                valid,
                k_ptr + krow * stride_kr + kvh * stride_kh,
                v_ptr + krow * stride_vr + kvh * stride_vh,
                ks_ptr + krow * stride_ksr + kvh * stride_ksh,
                vs_ptr + krow * stride_vsr + kvh * stride_vsh,
                written,
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


def tile_keywords(
    q: torch.Tensor, dv: int, group: int, qb: int, dc: int, bdv: int, scaled: bool
) -> dict[str, Any]:
    """The tile keywords every attention kernel (this one's, triton_window's) launches with, for
    q [N, Hq, D], values dv wide, `group` q heads a KV head, and tiles(...)'s (qb, dc, bdv)."""
    d = q.shape[-1]
    return dict(
        G=group,
        GP=next_power_of_2(group),
        QB=qb,
        NSUB=QUERY_ROWS // qb,
        D=d,
        DC=dc,
        BDV=bdv,
        KT=KEY_TILE,
        SCALED=scaled,
        IEEE=q.dtype == torch.float32,
        INTERP=interpreting(),
        DVB=dv // bdv,
        SEG=key_split.SEGMENT,
        num_warps=warps(d, dv),
        num_stages=2,
    )


def paged_attention(
    q: torch.Tensor,
    k_rows: torch.Tensor,
    v_rows: torch.Tensor,
    positions: torch.Tensor,
    meta: PassMeta,
    page_rows: int,
    *,
    scale: float,
    window: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    parts: int | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; k_rows [P*R, Hkv, D], v_rows [P*R, Hkv, Dv] (flat paged buffers holding
    this pass's rows); positions [N]; k_scales, v_scales [P*R, Hkv, 1] when the rows are fp8.
    parts: programs sharing a row tile's key segments (triton_key_split; by default from the
    pass's size). Returns [N, Hq, Dv] in q's dtype."""
    n, hq, d = q.shape
    hkv, dv = k_rows.shape[1], v_rows.shape[-1]
    out = torch.empty(n, hq, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_rows.stride(-1) == 1 and v_rows.stride(-1) == 1
    group = hq // hkv
    scaled = k_scales is not None
    qb, dc, bdv = tiles(d, dv, group, scaled)
    nsub = QUERY_ROWS // qb
    ks, vs = (k_scales, v_scales) if scaled else (k_rows, v_rows)  # unread unless scaled
    assert ks is not None and vs is not None  # both scales or neither
    dvb = dv // bdv
    span = meta.table.shape[1] * page_rows
    if window is not None:
        span = min(span, window + KEY_TILE + QUERY_ROWS)
    nseg = cdiv(span, key_split.SEGMENT) + (window is not None)
    split = key_split.plan(
        q, out, key_split.live_tiles(meta.num_blocks, nsub, n, qb), hkv, dvb, nseg, parts
    )
    _attention_kernel[(meta.num_blocks * nsub, hkv, dvb * split.parts)](
        q,
        k_rows,
        v_rows,
        ks,
        vs,
        out,
        positions,
        meta.block_stream,
        meta.block_row0,
        meta.block_len,
        meta.stream_start,
        meta.stream_len,
        meta.table,
        meta.table.stride(0),
        meta.table.stride(1),
        page_rows,
        scale,
        window or 0,
        q.stride(0),
        q.stride(1),
        k_rows.stride(0),
        k_rows.stride(1),
        v_rows.stride(0),
        v_rows.stride(1),
        ks.stride(0),
        ks.stride(1),
        vs.stride(0),
        vs.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_WINDOW=window is not None,
        **tile_keywords(q, dv, group, qb, dc, bdv, scaled),
        **split.kernel,
        **launch_options(q),
    )
    split.finish(out, positions, window, bdv)
    return out
