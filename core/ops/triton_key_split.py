"""Attention's keys in segments, so a few query rows over a long context can spread over the GPU
(flash-decoding) and still get the bits they get in any other pass.

Every attention kernel (triton_attention.py, triton_window.py) cuts a row's keys into segments of
SEGMENT keys aligned to absolute positions, runs the online softmax over each segment from a
fresh start, and folds the segments' (max, sum, weighted values) into the row's total in segment
order with `merge`. A segment a row cannot see is an exact identity in `merge` (its max is -inf,
its sum 0). So a row's result depends only on its position and its stream's keys, whoever
computes the segments: one program walking them in order (`merge` as it goes), or programs
that each take every PARTS-th segment and leave it in a workspace for `combine` to fold in the
same order with the same `merge`. Which way a pass goes (`parts`) is a matter of speed only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, cdiv

SEGMENT = 256  # keys; a multiple of the key tile (64)
TARGET_PROGRAMS = 264  # two programs per SM of an H200: split until a pass has about this many
WARPS = 4  # of a narrow-head attention program, paged or ring (wide: triton_attention.WIDE_WARPS)


def parts_for(programs: int, segments: int) -> int:
    """How many programs share a row tile's segments: 1 (one program walks them all) when the
    pass has a quarter of TARGET_PROGRAMS or more (a split of 2 or 3 gains less than its
    combine costs: docs/performance.md, "KEY_SPLIT"), else enough to reach TARGET_PROGRAMS."""
    want = cdiv(TARGET_PROGRAMS, max(programs, 1))
    if want < 4 or segments <= 1:
        return 1
    return min(segments, want)


def live_tiles(blocks: int, nsub: int, rows: int, qb: int) -> int:
    """At most how many of a pass's blocks*nsub row tiles hold rows (a decode row fills one
    of its block's nsub parts)."""
    return min(blocks * nsub, blocks + rows // qb)


@dataclass
class Split:
    """How a pass's attention launch shares its key segments: `parts` programs a row tile (the
    grid's third dimension is output blocks x parts), `kernel` the keywords the kernel takes
    for it (none when one program walks them), and the workspace `combine` folds."""

    parts: int
    kernel: dict[str, Any]
    ws: torch.Tensor | None = None
    ml: torch.Tensor | None = None

    def finish(
        self,
        out: torch.Tensor,
        positions: torch.Tensor,
        window: int | None,
        bdv: int,
        upto: torch.Tensor | None = None,
    ) -> None:
        """After the attention kernel: out from the partials, when they were shared (upto: the
        last key each row sees, when not its own position: media blocks)."""
        if self.ws is not None:
            assert self.ml is not None  # set with ws
            combine(self.ws, self.ml, out, positions, window, bdv, upto)


def plan(
    q: torch.Tensor,
    out: torch.Tensor,
    tiles: int,
    kv_heads: int,
    out_blocks: int,
    segments: int,
    parts: int | None = None,
) -> Split:
    """The split of a launch over `tiles` live row tiles (live_tiles) x kv_heads x out_blocks
    programs, into `segments` segment slots a row; parts: forced (tests, benchmarks)."""
    if parts is None:
        parts = parts_for(tiles * kv_heads * out_blocks, segments)
    if parts == 1:
        return Split(1, {})
    n, hq, dv = out.shape
    ws = torch.empty(n, hq, segments, dv, dtype=torch.float32, device=q.device)
    ml = torch.empty(n, hq, segments, 2, dtype=torch.float32, device=q.device)
    return Split(
        parts, dict(ws_ptr=ws, ml_ptr=ml, parts=parts, HQ=hq, nseg=segments, SPLIT=True), ws, ml
    )


@triton.jit
def fresh(M: tl.constexpr, BDV: tl.constexpr):
    return (
        tl.full((M,), float("-inf"), dtype=tl.float32),
        tl.zeros((M,), dtype=tl.float32),
        tl.zeros((M, BDV), dtype=tl.float32),
    )


@triton.jit
def merge(m_t, l_t, acc_t, m_s, l_s, acc_s):
    """A segment's (max m_s [M], sum l_s [M], values acc_s [M, BDV]) folded into the total's.
    Explicit fma: the same operations in every kernel, whatever the compiler would contract."""
    m = tl.maximum(m_t, m_s)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a = tl.exp(m_t - m_safe)
    b = tl.exp(m_s - m_safe)
    l_t = tl.fma(l_t, a, l_s * b)
    acc_t = tl.fma(acc_t, a[:, None], acc_s * b[:, None])
    return m, l_t, acc_t


@triton.jit
def finish(l_t, acc_t):
    return acc_t / tl.where(l_t > 0, l_t, 1.0)[:, None]  # 1: a row that saw nothing


@triton.jit
def store_partial(
    ws_ptr,
    ml_ptr,
    qrow,
    head,
    valid,
    slot,
    m_s,
    l_s,
    acc_s,
    dv0,
    nseg,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
):
    """Segment slot `slot`'s partial of the tile's valid rows (qrow, head) to the workspace."""
    at = (qrow * HQ + head) * nseg + slot  # [M] (row, head, slot)
    dv = dv0 + tl.arange(0, BDV)
    tl.store(ws_ptr + at[:, None] * DV + dv[None, :], acc_s, mask=valid[:, None])
    tl.store(ml_ptr + at * 2, m_s, mask=valid)
    tl.store(ml_ptr + at * 2 + 1, l_s, mask=valid)


@triton.jit
def end_segment(
    m_t,
    l_t,
    acc_t,
    m_s,
    l_s,
    acc_s,
    ws_ptr,
    ml_ptr,
    qrow,
    head,
    valid,
    seg,
    dv0,
    nseg,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """A segment's partial done: to the workspace (SPLIT: `combine` folds it later), else
    folded into the row's total now. Returns the total."""
    if SPLIT:
        store_partial(
            ws_ptr, ml_ptr, qrow, head, valid, seg % nseg, m_s, l_s, acc_s, dv0, nseg, HQ, DV, BDV
        )
    else:
        m_t, l_t, acc_t = merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    return m_t, l_t, acc_t


@triton.jit
def store_total(
    o_ptr,
    qrow,
    head,
    valid,
    l_t,
    acc_t,
    dv0,
    stride_on,
    stride_oh,
    BDV: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The tile's rows out, when its program walked all their segments (not SPLIT)."""
    if not SPLIT:
        dv = dv0 + tl.arange(0, BDV)
        tl.store(
            o_ptr + qrow[:, None] * stride_on + head[:, None] * stride_oh + dv[None, :],
            finish(l_t, acc_t).to(o_ptr.dtype.element_ty),
            mask=valid[:, None],
        )


# nseg (a row's segment slots) follows the pass's table width: a constexpr would compile anew for
# each width a split pass meets (a first resume after a long prefix waited ~1 s for it)
@triton.jit(do_not_specialize=["window", "nseg"])
def _combine_kernel(
    ws_ptr,
    ml_ptr,
    o_ptr,
    pos_ptr,
    window,
    nseg,
    stride_on,
    stride_oh,
    HQ: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    SEG: tl.constexpr,
    PDL: tl.constexpr = False,
    up_ptr=None,
    HAS_UP: tl.constexpr = False,
):
    """Program (row, head, output block): the row's segments, in order, merged; written out."""
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dv0 = tl.program_id(2) * BDV
    pos = tl.load(pos_ptr + row).to(tl.int32)
    lo = 0
    if window > 0:
        lo = tl.maximum(pos - window + 1, 0)
    if HAS_UP:  # the segments up to the row's last visible key
        pos = tl.load(up_ptr + row).to(tl.int32)
    m_t, l_t, acc_t = fresh(1, BDV)
    dv = dv0 + tl.arange(0, BDV)
    base = (row * HQ + head) * nseg
    one = tl.arange(0, 1)
    for seg in range(lo // SEG, pos // SEG + 1):
        at = base + seg % nseg + one  # [1]
        m_s = tl.load(ml_ptr + at * 2)
        l_s = tl.load(ml_ptr + at * 2 + 1)
        acc_s = tl.load(ws_ptr + at[:, None] * DV + dv[None, :])
        m_t, l_t, acc_t = merge(m_t, l_t, acc_t, m_s, l_s, acc_s)
    out = finish(l_t, acc_t)
    tl.store(
        o_ptr + row * stride_on + head * stride_oh + dv[None, :] + one[:, None] * 0,
        out.to(o_ptr.dtype.element_ty),
    )


def combine(
    ws: torch.Tensor,
    ml: torch.Tensor,
    out: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    bdv: int,
    upto: torch.Tensor | None = None,
) -> None:
    """out [N, Hq, Dv] from the partials a split pass left in (ws, ml) (`workspace`); upto [N]:
    each row's last visible key, where it is not the row's position (media blocks)."""
    n, hq, nseg, dv = ws.shape
    blocks = {} if upto is None else dict(up_ptr=upto, HAS_UP=True)
    _combine_kernel[(n, hq, dv // bdv)](
        ws,
        ml,
        out,
        positions,
        window or 0,
        nseg,
        out.stride(0),
        out.stride(1),
        HQ=hq,
        DV=dv,
        BDV=bdv,
        SEG=SEGMENT,
        num_warps=4,
        **blocks,
        **launch_options(out),
    )
