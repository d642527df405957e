"""Causal attention of a pass over paged K/V on the GPU in Triton (prompt rows and decode rows
together, GQA), as ops/attention.py computes it.

A program takes one query block (up to QUERY_ROWS consecutive rows of one stream, times the G
query heads that share a KV head) and walks key tiles of KEY_TILE aligned to absolute positions,
from the first its rows can see to the last, with an online softmax in fp32. A tile a row cannot
see is an exact no-op for it, so a row's result depends only on its position and its stream's
keys, never on where the pass cut the prompt or what else is in the pass. Keys are read through
the stream's page table; rows past what the stream has written are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_util import interpreting, mma

from .pass_meta import QUERY_ROWS, PassMeta

KEY_TILE = 64


@triton.jit(do_not_specialize=["stride_ts", "stride_tp", "window"])  # page tables of any width
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, block_stream, block_row0, block_len, stream_start,
    stream_len, table_ptr, stride_ts, stride_tp, page_rows, scale, window,
    stride_qn, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh, stride_on, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, QB: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, KT: tl.constexpr,
    HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
):
    blk = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(block_stream + blk)
    row0 = tl.load(block_row0 + blk)
    n = tl.load(block_len + blk)
    end = tl.load(stream_start + s) + tl.load(stream_len + s)  # keys [0, end) are written
    m = tl.arange(0, QB * GP)
    r = m // GP
    head = kvh * G + m % GP
    valid = (r < n) & (m % GP < G)
    qrow = (row0 + r).to(tl.int64)
    qpos = tl.load(pos_ptr + qrow, mask=valid, other=0).to(tl.int32)
    d = tl.arange(0, D)
    dv = tl.arange(0, DV)
    q = tl.load(q_ptr + qrow[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    first = tl.load(pos_ptr + row0).to(tl.int32)
    hi = tl.load(pos_ptr + row0 + n - 1).to(tl.int32) + 1
    lo = 0
    if HAS_WINDOW:
        lo = (tl.maximum(first - window + 1, 0) // KT) * KT
    m_i = tl.full((QB * GP,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((QB * GP,), dtype=tl.float32)
    acc = tl.zeros((QB * GP, DV), dtype=tl.float32)
    kt = tl.arange(0, KT)
    for t0 in range(lo, hi, KT):
        j = t0 + kt
        written = j < end
        page = tl.load(table_ptr + s * stride_ts + (j // page_rows) * stride_tp, mask=written,
                       other=0)
        krow = page.to(tl.int64) * page_rows + j % page_rows
        k = tl.load(k_ptr + krow[:, None] * stride_kr + kvh * stride_kh + d[None, :],
                    mask=written[:, None], other=0.0)
        sc = mma(q, tl.trans(k), tl.zeros((QB * GP, KT), dtype=tl.float32), IEEE, INTERP) * scale
        visible = j[None, :] <= qpos[:, None]
        if HAS_WINDOW:
            visible = visible & (j[None, :] > qpos[:, None] - window)
        sc = tl.where(visible, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(sc - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + krow[:, None] * stride_vr + kvh * stride_vh + dv[None, :],
                    mask=written[:, None], other=0.0)
        acc = mma(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERP)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + qrow[:, None] * stride_on + head[:, None] * stride_oh + dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


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
) -> torch.Tensor:
    """q [N, Hq, D]; k_rows [P*R, Hkv, D], v_rows [P*R, Hkv, Dv] (flat paged buffers holding
    this pass's rows); positions [N]. Returns [N, Hq, Dv] in q's dtype."""
    n, hq, d = q.shape
    hkv, dv = k_rows.shape[1], v_rows.shape[-1]
    out = torch.empty(n, hq, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    _attention_kernel[(meta.num_blocks, hkv)](
        q, k_rows, v_rows, out, positions, meta.block_stream, meta.block_row0, meta.block_len,
        meta.stream_start, meta.stream_len, meta.table, meta.table.stride(0),
        meta.table.stride(1), page_rows, scale, window or 0,
        q.stride(0), q.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0),
        v_rows.stride(1), out.stride(0), out.stride(1),
        G=hq // hkv, GP=triton.next_power_of_2(hq // hkv), QB=QUERY_ROWS, D=d, DV=dv, KT=KEY_TILE, HAS_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32, INTERP=interpreting(), num_warps=4, num_stages=2,
    )
    return out
