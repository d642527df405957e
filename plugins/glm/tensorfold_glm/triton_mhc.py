"""The mHC residual on the GPU in Triton (mhc.py is the torch reference): the collapse fused with
the RMSNorm after it, the expand, the streams a pass starts from (`streams_in`) and the final
mean of the logit rows' streams (`head`), each one launch.

Collapse, per token, in two launches:
1. `_project_kernel`: the flattened streams f [hc·H] against fn [(2+hc)·hc, hc·H] in fp32
   (three tf32 products on the GPU, "tf32x3", about fp32's accuracy; IEEE in the interpreter;
   no cuBLAS), and Σf², over a fixed split of the hc·H axis (pieces of a width fixed by hc·H
   alone: 64 of 256 columns at the real shape, so one row's call is 64 programs of 4 steps
   rather than a few long ones), each piece walked in BLOCK_K steps from its start.
2. `_collapse_kernel`: the pieces summed in order, z = (f·fn)·rsqrt(mean f² + eps) (the
   reference normalises f first: the same value, rounded once less), the gates, the 20-iteration
   eps-ratio Sinkhorn, the bf16 collapse Σ pre_m·X_m (fp32 accumulate in stream order), and the
   block's RMSNorm of it.
Every order is fixed by the widths, never by the row count: a row's bits do not depend on the
other rows of the pass.

`expand_collapse_norm` (switches.FUSED_EXPAND_COLLAPSE, for passes of a few rows): a
sublayer's expand and the next sublayer's collapse in one launch, `_expand_collapse_kernel`,
one program a (row, piece): the piece's columns of the expanded streams (stored), then their
projection on the same 16-row tile as `_project_kernel` with the row alone live; the row's last
piece to arrive (an arrival counter a row, as triton_splitk's) runs `_collapse_kernel`'s
whole-row collapse. The same arithmetic in the same order as the three launches it replaces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.ops import switches
from tensorfold.ops import triton_splitk as splitk
from tensorfold.ops.gpu import launch_options
from tensorfold.ops.triton_util import after_prior, cdiv, interpreting, next_power_of_2

PROJECT_ROWS = 16  # tl.dot's smallest M
BLOCK_K = 64
PIECE = 256  # the hc·H axis is cut in pieces of about this many columns, at most MAX_SPLIT
MAX_SPLIT = 64
COLLAPSE_ROWS = 4
BLOCK_H = 512
# The collapse a program a row, its whole row in one tile (up to WHOLE_ROW_MAX columns; wider
# rows COLLAPSE_ROWS a program in BLOCK_H column blocks): the row's collapse computed once and
# kept for the norm, the pieces' loop unrolled (their loads in flight together; the same sums in
# the same order; docs/performance.md, "WHOLE_ROW").
WHOLE_ROW_MAX = 8192
WHOLE_ROW_WARPS = 4
EXPAND_ROWS = 4
EXPAND_BLOCK_H = 512  # columns an expand program takes (any: each column is its own)
# A sublayer's expand and the next one's collapse in one launch for passes of up to
# FUSED_MAX_ROWS rows (expand_collapse_norm): a program a (row, piece) expands its piece of the
# row's streams, stores it and projects it; the row's last piece to arrive collapses the row.
# The same arithmetic as expand, then collapse_norm's two launches with the row alone (its
# collapse on the whole-row tile), so the same bits; two launches fewer a layer.
FUSED_MAX_ROWS = 8


def split_for(width: int) -> tuple[int, int]:
    """(pieces, columns a piece) for an hc·H-wide projection: by the width alone."""
    pieces = max(1, min(MAX_SPLIT, width // PIECE))
    cols = cdiv(cdiv(width, pieces), BLOCK_K) * BLOCK_K
    return cdiv(width, cols), cols


@triton.jit
def _dot_fp32(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b for fp32 operands at about fp32's accuracy: three tf32 products on the
    tensor cores (IEEE in the interpreter)."""
    if INTERP:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    return out


@triton.jit
def _project_piece(
    x_ptr,
    fn_ptr,
    rows,
    rmask,
    k0,
    width,
    cols,
    W: tl.constexpr,
    WP: tl.constexpr,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    INTERP: tl.constexpr,
):
    """The piece [k0, k0 + cols) of rows' flattened streams against fn, in BK steps from k0:
    (f·fnᵀ [ROWS, WP], Σf² [ROWS]), fp32."""
    w_rows = tl.arange(0, WP)
    acc = tl.zeros((ROWS, WP), dtype=tl.float32)
    ss = tl.zeros((ROWS,), dtype=tl.float32)
    for kb in range(0, cols, BK):
        k = k0 + kb + tl.arange(0, BK)
        kmask = (k < width) & (kb + tl.arange(0, BK) < cols)
        f = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * width + k[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        ).to(tl.float32)
        ss += tl.sum(f * f, axis=1)
        fn = tl.load(
            fn_ptr + w_rows[:, None] * width + k[None, :],
            mask=(w_rows < W)[:, None] & kmask[None, :],
            other=0.0,
        )
        acc = _dot_fp32(f, tl.trans(fn), acc, INTERP)
    return acc, ss


@triton.jit(do_not_specialize=["n_rows"])
def _project_kernel(
    x_ptr,
    fn_ptr,
    z_ptr,
    ss_ptr,
    n_rows,
    width,
    cols,
    W: tl.constexpr,
    WP: tl.constexpr,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    piece = tl.program_id(1)
    acc, ss = _project_piece(
        x_ptr, fn_ptr, rows, rows < n_rows, piece * cols, width, cols, W, WP, ROWS, BK, INTERP
    )
    n_pad = tl.num_programs(0) * ROWS
    base = piece.to(tl.int64) * n_pad + rows.to(tl.int64)
    tl.store(z_ptr + base[:, None] * WP + tl.arange(0, WP)[None, :], acc)
    tl.store(ss_ptr + base, ss)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _collapse_block(
    x_ptr,
    row_base,
    cols,
    mask,
    pre,
    c,
    H,
    HC: tl.constexpr,
    ROWS: tl.constexpr,
    BH: tl.constexpr,
    VOLATILE: tl.constexpr,
):
    """Σ_m pre_m · X_m over one block of columns, fp32, in stream order. -> [ROWS, BH].
    VOLATILE: X was stored by other programs of this launch (read past L1)."""
    x = tl.zeros((ROWS, BH), dtype=tl.float32)
    for m in tl.static_range(HC):
        pre_m = tl.sum(tl.where(c[None, :] == m, pre, 0.0), axis=1)
        s = tl.load(
            x_ptr + row_base + m * H + cols[None, :], mask=mask, other=0.0, volatile=VOLATILE
        )
        if m == 0:
            x = pre_m[:, None] * s.to(tl.float32)
        else:
            x = x + pre_m[:, None] * s.to(tl.float32)
    return x


@triton.jit
def _collapse_rows(
    x_ptr,
    z_ptr,
    ss_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    rows,
    rmask,
    n_pad,
    H,
    iters,
    rms_eps,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    WP: tl.constexpr,
    PIECES: tl.constexpr,
    ROWS: tl.constexpr,
    BH: tl.constexpr,
    WHOLE: tl.constexpr,
    VOLATILE: tl.constexpr,
):
    """The collapse and norm of rows (rmask: live), from the projection's pieces z [PIECES,
    n_pad, WP] and ss [PIECES, n_pad], each in piece order. WHOLE: BH covers H; the pieces' loop
    unrolled, the collapse computed once."""
    r64 = rows.to(tl.int64)
    c = tl.arange(0, HC)
    m3 = tl.arange(0, HC)[None, :, None]
    n3 = tl.arange(0, HC)[None, None, :]
    ss = tl.zeros((ROWS,), dtype=tl.float32)
    z_pre = tl.zeros((ROWS, HC), dtype=tl.float32)
    z_post = tl.zeros((ROWS, HC), dtype=tl.float32)
    z_comb = tl.zeros((ROWS, HC, HC), dtype=tl.float32)
    if WHOLE:
        for p in tl.static_range(PIECES):  # the pieces in order
            at = p * n_pad + r64
            ss += tl.load(ss_ptr + at, volatile=VOLATILE)
            z_pre += tl.load(z_ptr + at[:, None] * WP + c[None, :], volatile=VOLATILE)
            z_post += tl.load(z_ptr + at[:, None] * WP + HC + c[None, :], volatile=VOLATILE)
            z_comb += tl.load(
                z_ptr + at[:, None, None] * WP + 2 * HC + m3 * HC + n3, volatile=VOLATILE
            )
    else:
        for p in range(PIECES):  # the pieces in order
            at = p * n_pad + r64
            ss += tl.load(ss_ptr + at, volatile=VOLATILE)
            z_pre += tl.load(z_ptr + at[:, None] * WP + c[None, :], volatile=VOLATILE)
            z_post += tl.load(z_ptr + at[:, None] * WP + HC + c[None, :], volatile=VOLATILE)
            z_comb += tl.load(
                z_ptr + at[:, None, None] * WP + 2 * HC + m3 * HC + n3, volatile=VOLATILE
            )
    r = tl.math.rsqrt(ss / (HC * H) + rms_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = _sigmoid(z_pre * r[:, None] * s0 + tl.load(base_ptr + c)[None, :]) + hc_eps
    post = 2.0 * _sigmoid(z_post * r[:, None] * s1 + tl.load(base_ptr + HC + c)[None, :])
    v = z_comb * r[:, None, None] * s2 + tl.load(base_ptr + 2 * HC + m3 * HC + n3)
    e = tl.exp(v - tl.max(v, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)  # columns first
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(post_ptr + r64[:, None] * HC + c[None, :], post, mask=rmask[:, None])
    tl.store(
        comb_ptr + r64[:, None, None] * HC * HC + m3 * HC + n3, comb, mask=rmask[:, None, None]
    )

    dt = x_ptr.dtype.element_ty
    row_base = r64[:, None] * HC * H
    if WHOLE:
        cols = tl.arange(0, BH)
        mask = rmask[:, None] & (cols < H)[None, :]
        xr = _collapse_block(x_ptr, row_base, cols, mask, pre, c, H, HC, ROWS, BH, VOLATILE)
        xr = xr.to(dt).to(tl.float32)
        rn = tl.math.rsqrt(tl.sum(xr * xr, axis=1) / H + norm_eps)
        w = tl.load(norm_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
        y = w[None, :] * (xr * rn[:, None]).to(dt).to(tl.float32)
        tl.store(
            out_ptr + r64[:, None] * H + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask
        )
    else:
        ss2 = tl.zeros((ROWS,), dtype=tl.float32)
        for hb in range(0, H, BH):  # the collapse, rounded, and its Σx²
            cols = hb + tl.arange(0, BH)
            mask = rmask[:, None] & (cols < H)[None, :]
            x = _collapse_block(x_ptr, row_base, cols, mask, pre, c, H, HC, ROWS, BH, VOLATILE)
            xr = x.to(dt).to(tl.float32)
            ss2 += tl.sum(xr * xr, axis=1)
        rn = tl.math.rsqrt(ss2 / H + norm_eps)
        for hb in range(0, H, BH):  # the same collapse again, normed
            cols = hb + tl.arange(0, BH)
            mask = rmask[:, None] & (cols < H)[None, :]
            x = _collapse_block(x_ptr, row_base, cols, mask, pre, c, H, HC, ROWS, BH, VOLATILE)
            normed = (x.to(dt).to(tl.float32) * rn[:, None]).to(dt)
            w = tl.load(norm_w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
            y = w[None, :] * normed.to(tl.float32)
            tl.store(
                out_ptr + r64[:, None] * H + cols[None, :],
                y.to(out_ptr.dtype.element_ty),
                mask=mask,
            )


@triton.jit(do_not_specialize=["n_rows", "iters"])
def _collapse_kernel(
    x_ptr,
    z_ptr,
    ss_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    n_rows,
    n_pad,
    H,
    iters,
    rms_eps,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    WP: tl.constexpr,
    PIECES: tl.constexpr,
    ROWS: tl.constexpr,
    BH: tl.constexpr,
    WHOLE: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    _collapse_rows(
        x_ptr,
        z_ptr,
        ss_ptr,
        base_ptr,
        scale_ptr,
        norm_w_ptr,
        post_ptr,
        comb_ptr,
        out_ptr,
        rows,
        rows < n_rows,
        n_pad,
        H,
        iters,
        rms_eps,
        hc_eps,
        norm_eps,
        HC,
        WP,
        PIECES,
        ROWS,
        BH,
        WHOLE,
        False,
    )


def collapse_norm(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    iters: int,
    rms_eps: float,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, hc, H]; fn [(2+hc)·hc, hc·H] fp32; base [(2+hc)·hc], scale [3] fp32;
    norm_weight [H]. Returns (post [N, hc] fp32, comb [N, hc, hc] fp32,
    rms_norm(collapse) [N, H]). hc must be a power of two."""
    n, hc, h = streams.shape
    width = hc * h
    w = (2 + hc) * hc
    wp = max(16, next_power_of_2(w))
    streams = streams.contiguous()
    dev = streams.device
    out = torch.empty(n, h, dtype=torch.promote_types(streams.dtype, norm_weight.dtype), device=dev)
    post = torch.empty(n, hc, dtype=torch.float32, device=dev)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=dev)
    if n == 0:
        return post, comb, out
    pieces, cols = split_for(width)
    tiles = cdiv(n, PROJECT_ROWS)
    n_pad = tiles * PROJECT_ROWS
    z = torch.empty(pieces, n_pad, wp, dtype=torch.float32, device=dev)
    ss = torch.empty(pieces, n_pad, dtype=torch.float32, device=dev)
    _project_kernel[(tiles, pieces)](
        streams,
        fn.contiguous(),
        z,
        ss,
        n,
        width,
        cols,
        W=w,
        WP=wp,
        ROWS=PROJECT_ROWS,
        BK=BLOCK_K,
        INTERP=interpreting(),
        num_warps=4,
        **launch_options(streams),
    )
    whole = h <= WHOLE_ROW_MAX
    rows = 1 if whole else COLLAPSE_ROWS
    _collapse_kernel[(cdiv(n, rows),)](
        streams,
        z,
        ss,
        base.contiguous(),
        scale.contiguous(),
        norm_weight.contiguous(),
        post,
        comb,
        out,
        n,
        n_pad,
        h,
        iters,
        rms_eps,
        hc_eps,
        norm_eps,
        HC=hc,
        WP=wp,
        PIECES=pieces,
        ROWS=rows,
        BH=next_power_of_2(h) if whole else min(BLOCK_H, next_power_of_2(h)),
        WHOLE=whole,
        num_warps=WHOLE_ROW_WARPS if whole else 4,
        **launch_options(streams),
    )
    return post, comb, out


@triton.jit(do_not_specialize=["n_rows"])
def _expand_kernel(
    post_ptr,
    comb_ptr,
    y_ptr,
    res_ptr,
    out_ptr,
    n_rows,
    H,
    HC: tl.constexpr,
    ROWS: tl.constexpr,
    BH: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)
    dt = out_ptr.dtype.element_ty
    y = tl.load(y_ptr + r64[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(HC):
        mixed = tl.zeros((ROWS, BH), dtype=tl.float32)
        for m in tl.static_range(HC):
            cm = tl.load(comb_ptr + r64 * HC * HC + m * HC + j, mask=rmask, other=0.0)
            cm = cm.to(dt).to(tl.float32)
            r = tl.load(
                res_ptr + (r64[:, None] * HC + m) * H + cols[None, :], mask=mask, other=0.0
            ).to(tl.float32)
            if m == 0:
                mixed = cm[:, None] * r
            else:
                mixed = mixed + cm[:, None] * r
        p = tl.load(post_ptr + r64 * HC + j, mask=rmask, other=0.0).to(dt).to(tl.float32)
        out = (p[:, None] * y).to(dt).to(tl.float32) + mixed.to(dt).to(tl.float32)
        tl.store(out_ptr + (r64[:, None] * HC + j) * H + cols[None, :], out.to(dt), mask=mask)


def expand(
    post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """mhc.expand: stream j = post_j · y + Σ_m comb[m, j] · residual_m in the model dtype.
    post [N, hc]; comb [N, hc, hc]; y [N, H]; residual [N, hc, H] -> [N, hc, H]."""
    n, hc, h = residual.shape
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    if n:
        bh = min(EXPAND_BLOCK_H, next_power_of_2(h))
        _expand_kernel[(cdiv(n, EXPAND_ROWS), cdiv(h, bh))](
            post.contiguous(),
            comb.contiguous(),
            y.contiguous(),
            residual,
            out,
            n,
            h,
            HC=hc,
            ROWS=EXPAND_ROWS,
            BH=bh,
            num_warps=4,
            **launch_options(residual),
        )
    return out


@triton.jit(do_not_specialize=["n_rows", "iters"])
def _expand_collapse_kernel(
    post_ptr,
    comb_ptr,
    y_ptr,
    res_ptr,
    streams_ptr,
    fn_ptr,
    z_ptr,
    ss_ptr,
    cnt_ptr,
    base_ptr,
    scale_ptr,
    norm_w_ptr,
    post2_ptr,
    comb2_ptr,
    out_ptr,
    n_rows,
    H,
    width,
    cols,
    iters,
    rms_eps,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    PIECES: tl.constexpr,
    ROWS: tl.constexpr,
    BK: tl.constexpr,
    BH: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (row, piece): the expand of columns [piece·cols, +cols) of the row's flattened
    streams (stored), then their projection on a ROWS-row tile with the row alone live; the
    row's last piece to arrive then collapses the row from the stored streams."""
    after_prior(PDL)
    row = tl.program_id(0)
    piece = tl.program_id(1)
    r64 = row.to(tl.int64)
    dt = streams_ptr.dtype.element_ty
    k0 = piece * cols
    for kb in range(0, cols, BK):  # expand's arithmetic, column by column
        k = k0 + kb + tl.arange(0, BK)
        kmask = (k < width) & (kb + tl.arange(0, BK) < cols)
        j = k // H
        h = k - j * H
        y = tl.load(y_ptr + r64 * H + h, mask=kmask, other=0.0).to(tl.float32)
        mixed = tl.zeros((BK,), dtype=tl.float32)
        for m in tl.static_range(HC):
            cm = tl.load(comb_ptr + r64 * HC * HC + m * HC + j, mask=kmask, other=0.0)
            cm = cm.to(dt).to(tl.float32)
            r = tl.load(res_ptr + (r64 * HC + m) * H + h, mask=kmask, other=0.0).to(tl.float32)
            if m == 0:
                mixed = cm * r
            else:
                mixed = mixed + cm * r
        p = tl.load(post_ptr + r64 * HC + j, mask=kmask, other=0.0).to(dt).to(tl.float32)
        out = (p * y).to(dt).to(tl.float32) + mixed.to(dt).to(tl.float32)
        tl.store(streams_ptr + r64 * width + k, out.to(dt), mask=kmask)
    tl.debug_barrier()  # the piece's streams stored by the whole program before it reads them
    rows = row + tl.arange(0, ROWS)
    live = tl.arange(0, ROWS) == 0
    acc, ss = _project_piece(
        streams_ptr, fn_ptr, rows, live, k0, width, cols, W, WP, ROWS, BK, INTERP
    )
    at = piece.to(tl.int64) * n_rows + rows.to(tl.int64)
    tl.store(z_ptr + at[:, None] * WP + tl.arange(0, WP)[None, :], acc, mask=live[:, None])
    tl.store(ss_ptr + at, ss, mask=live)
    if splitk.arrive(cnt_ptr, row, PIECES, INTERP):
        one = row + tl.arange(0, 1)
        _collapse_rows(
            streams_ptr,
            z_ptr,
            ss_ptr,
            base_ptr,
            scale_ptr,
            norm_w_ptr,
            post2_ptr,
            comb2_ptr,
            out_ptr,
            one,
            one < n_rows,
            n_rows,
            H,
            iters,
            rms_eps,
            hc_eps,
            norm_eps,
            HC,
            WP,
            PIECES,
            1,
            BH,
            True,
            True,
        )
        splitk.depart(cnt_ptr, row)


def expand_collapse_norm(
    post: torch.Tensor,
    comb: torch.Tensor,
    y: torch.Tensor,
    residual: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    iters: int,
    rms_eps: float,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expand(post, comb, y, residual), then collapse_norm of the streams it makes with the next
    sublayer's fn, base, scale and norm_weight: (streams [N, hc, H], post' [N, hc] fp32,
    comb' [N, hc, hc] fp32, normed block input [N, H]). One launch for a pass of up to
    FUSED_MAX_ROWS rows (switches.FUSED_EXPAND_COLLAPSE), else expand's and collapse_norm's
    three."""
    n, hc, h = residual.shape
    width = hc * h
    fits = (
        switches.FUSED_EXPAND_COLLAPSE.on()
        and 0 < n <= FUSED_MAX_ROWS
        and h <= WHOLE_ROW_MAX
        and WHOLE_ROW_WARPS == 4
    )
    if not fits:
        streams = expand(post, comb, y, residual)
        return (
            streams,
            *collapse_norm(
                streams,
                fn,
                base,
                scale,
                norm_weight,
                iters=iters,
                rms_eps=rms_eps,
                hc_eps=hc_eps,
                norm_eps=norm_eps,
            ),
        )
    residual = residual.contiguous()
    dev = residual.device
    w = (2 + hc) * hc
    wp = max(16, next_power_of_2(w))
    pieces, cols = split_for(width)
    streams = torch.empty_like(residual)
    out = torch.empty(
        n, h, dtype=torch.promote_types(residual.dtype, norm_weight.dtype), device=dev
    )
    post2 = torch.empty(n, hc, dtype=torch.float32, device=dev)
    comb2 = torch.empty(n, hc, hc, dtype=torch.float32, device=dev)
    z = torch.empty(pieces, n, wp, dtype=torch.float32, device=dev)
    ss = torch.empty(pieces, n, dtype=torch.float32, device=dev)
    _expand_collapse_kernel[(n, pieces)](
        post.contiguous(),
        comb.contiguous(),
        y.contiguous(),
        residual,
        streams,
        fn.contiguous(),
        z,
        ss,
        splitk.counters(dev, n),
        base.contiguous(),
        scale.contiguous(),
        norm_weight.contiguous(),
        post2,
        comb2,
        out,
        n,
        h,
        width,
        cols,
        iters,
        rms_eps,
        hc_eps,
        norm_eps,
        HC=hc,
        W=w,
        WP=wp,
        PIECES=pieces,
        ROWS=PROJECT_ROWS,
        BK=BLOCK_K,
        BH=next_power_of_2(h),
        INTERP=interpreting(),
        num_warps=4,
        **launch_options(residual),
    )
    return streams, post2, comb2, out


@triton.jit(do_not_specialize=["H"])
def _streams_in_kernel(
    embed_ptr, token_ptr, out_ptr, H, HC: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    token = tl.load(token_ptr + row).to(tl.int64)
    e = tl.load(embed_ptr + token * H + cols, mask=mask)
    for m in tl.static_range(HC):
        tl.store(out_ptr + (row * HC + m) * H + cols, e, mask=mask)


def streams_in(embed: torch.Tensor, tokens: torch.Tensor, hc: int) -> torch.Tensor:
    """The residual streams a pass starts from: each token's embedding row, hc times, in one
    launch (the model's index_select then expand's copy). embed [V, H]; tokens [N] ->
    [N, hc, H]."""
    n, h = tokens.shape[0], embed.shape[1]
    out = torch.empty(n, hc, h, dtype=embed.dtype, device=embed.device)
    if n:
        bh = min(BLOCK_H, next_power_of_2(h))
        _streams_in_kernel[(n, cdiv(h, bh))](
            embed.contiguous(),
            tokens,
            out,
            h,
            HC=hc,
            BH=bh,
            num_warps=4,
            **launch_options(embed),
        )
    return out


@triton.jit(do_not_specialize=["H"])
def _head_kernel(
    x_ptr, rows_ptr, out_ptr, H, HC: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False
):
    after_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = cols < H
    row = tl.load(rows_ptr + r).to(tl.int64)
    total = tl.load(x_ptr + row * HC * H + cols, mask=mask, other=0.0).to(tl.float32)
    for m in tl.static_range(1, HC):
        total = total + tl.load(x_ptr + (row * HC + m) * H + cols, mask=mask, other=0.0).to(
            tl.float32
        )
    mean = tl.math.div_rn(total, tl.full((BH,), HC, dtype=tl.float32))
    tl.store(out_ptr + r * H + cols, mean.to(out_ptr.dtype.element_ty), mask=mask)


def head(streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """mhc.head of the pass's rows `rows` [R] (the logit rows) in one launch, where the index
    select and torch's float, add, divide and round took ten: streams [N, hc, H] -> [R, H], the
    streams summed in fp32 in order, divided by hc (IEEE), rounded to the streams' dtype."""
    _, hc, h = streams.shape
    r = rows.shape[0]
    streams = streams.contiguous()
    out = torch.empty(r, h, dtype=streams.dtype, device=streams.device)
    if r:
        bh = min(BLOCK_H, next_power_of_2(h))
        _head_kernel[(r, cdiv(h, bh))](
            streams, rows, out, h, HC=hc, BH=bh, num_warps=4, **launch_options(streams)
        )
    return out
