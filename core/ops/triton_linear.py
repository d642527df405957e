"""Batch-invariant linear layers on the GPU: x [M, K] @ w[N, K]ᵀ in Triton.

K is cut into SPLITS chunks (triton_splitk.py), each walked in BLOCK_K steps into an fp32 partial,
the partials summed in chunk order; BLOCK_K and SPLITS are chosen by the weight's shape (N, K)
only: the reduction order never depends on the row count M, so a row's bits do not depend on how
many rows share the call. The tile along M and N (and the warps) is chosen by M: 16-row tiles
for a few rows, 64-row tiles for decode-sized passes (up to SMALL_ROWS rows), 128-row tiles for
prompt passes; up to SPLIT_ROWS rows the chunks run in programs of their own (above, the
workspace of partials would cost more than the split gains). Every tile shape measured on an
H200 gave the same bits, and tests/test_triton_kernels.py checks the two choices agree bit for
bit under the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import triton_splitk as splitk
from .gpu import launch_options, prefetch_k
from .triton_util import (
    Fp8Scales,
    after_prior,
    cdiv,
    interpreting,
    mma,
    prefetch_rows,
    scale_rows,
    weight_tile,
)

TINY_BLOCK_M = 16  # passes of up to TINY_ROWS rows (one decode round of a few streams)
TINY_ROWS = 16
BLOCK_M = 64  # passes of up to SMALL_ROWS rows
PREFILL_BLOCK_M = 128  # larger passes
SMALL_ROWS = 256
# Passes of up to SPLIT_ROWS rows run each K chunk in a program of its own (the chunks' partials
# through a workspace); larger ones walk the chunks in one program a tile. The same chunks summed
# in the same order: the same bits (docs/performance.md, "SPLIT_ROWS").
SPLIT_ROWS = 64


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    warps: int
    stages: int
    wave: int = 0  # programs the K split aims at one row (0: triton_splitk.WAVE)


# (N, K) -> tiles, where measured better than the default on an H200 (bench/experiments/decode_kernels.py
# --tiles; docs/performance.md, "TUNED"). Every tile shape gave the same bits there: the k order
# (BLOCK_K and the split) fixes them.
TUNED: dict[tuple[int, int], Tiles] = {
    (6144, 2048): Tiles(32, 128, 4, 4, wave=1),  # lfm2 in_proj, unsplit
    (2048, 2048): Tiles(32, 128, 4, 4, wave=256),
    (3072, 2048): Tiles(32, 128, 4, 8, wave=1),  # LFM2-8B-A1B's q+k+v, unsplit
    (512, 2048): Tiles(32, 128, 4, 4),
    (32, 2048): Tiles(32, 128, 4, 4),
    (64, 2048): Tiles(32, 128, 4, 4),
    (4096, 2816): Tiles(64, 64, 4, 4, wave=256),  # gemma4 q
    (2816, 4096): Tiles(32, 64, 4, 4, wave=256),  # gemma4 o
    # gemma4's q+k+v (sliding layers) and q+k (full layers, k_eq_v) as one weight: in_proj's
    # unsplit tile
    (8192, 2816): Tiles(32, 128, 4, 4, wave=1),
    (9216, 2816): Tiles(32, 128, 4, 4, wave=1),
    (65536, 2048): Tiles(64, 64, 4, 6, wave=1),  # LFM2-8B-A1B's lm_head, unsplit
}


# (N, K) -> the tiles of an fp8 weight's passes of up to TINY_ROWS rows, where measured faster
# than the bf16 tiles (bench/fp8_kernels.py --tiles; none yet): half the bytes a step may want
# longer k steps or more stages. The K split and its chunks stay the bf16 tiles' (the bits);
# BLOCK_K must divide the chunk (a step then lies in one chunk and one scale block) and changes
# no bits on the GPU, where the MMAs chain one accumulator in k steps of 16 whatever BLOCK_K is.
# The interpreter adds each step's dot at once: there the bf16 tiles stay.
FP8_TUNED: dict[tuple[int, int], Tiles] = {}


def fp8_tiles(m: int, n: int, k: int, chunk: int, t: Tiles) -> Tiles:
    """The tiles of an fp8 weight's [m, k] @ [n, k]ᵀ pass: FP8_TUNED's where it has the shape,
    m is TINY_ROWS or fewer and its BLOCK_K divides the chunk; else t (the bf16 tiles)."""
    own = FP8_TUNED.get((n, k))
    if own is None or m > TINY_ROWS or chunk % own.block_k or interpreting():
        return t
    return own


def tiles_for(n: int, k: int) -> Tiles:
    if (n, k) in TUNED:
        return TUNED[(n, k)]
    if n >= 4096:
        return Tiles(128, 64, 4, 4)
    return Tiles(64, 64, 4, 4)


def splits_of(n: int, k: int) -> int:
    """K chunks for an [*, k] @ [n, k]ᵀ product: from the weight's shape only (they fix the bits)."""
    t = tiles_for(n, k)
    return splitk.splits_for(cdiv(n, t.block_n), cdiv(k, t.block_k), t.wave)


def pick(m: int, n: int, k: int) -> tuple[int, Tiles]:
    """(BLOCK_M, tiles) for an [m, k] @ [n, k]ᵀ product. BLOCK_K is tiles_for(n, k)'s at every
    m: only the M/N tiling and the warps change with the row count, never the k order."""
    t = tiles_for(n, k)
    if m <= TINY_ROWS:
        return TINY_BLOCK_M, t
    if m <= SMALL_ROWS:
        return BLOCK_M, t
    bn = 128 if n >= 1024 else t.block_n
    return PREFILL_BLOCK_M, Tiles(bn, t.block_k, 8, 3 if t.block_k <= 64 else 2, t.wave)


@triton.jit
def _chunk_product(
    x_ptr,
    w_ptr,
    rm,
    rn,
    M,
    N,
    k_lo,
    k_hi,
    stride_xm,
    stride_wn,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    s_rows,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
):
    """Σ over k in [k_lo, k_hi) of x[rm, k] · w[rn, k], in BLOCK_K steps from k_lo upward, fp32
    (FP8: w dequantized in registers, weight_tile)."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kin = (k0 + rk) < k_hi
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        b = weight_tile(w_ptrs, (rn[None, :] < N) & kin[:, None], s_rows, k0, dt, FP8, SBK, INTERP)
        acc = mma(a, b, acc, IEEE, INTERP)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    CHUNK,
    ws_rows,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,
    GROUPS: tl.constexpr = 1,
    s_ptr=None,
    stride_sn=0,
    SBN=1,
    FP8: tl.constexpr = False,
    SBK: tl.constexpr = 0,
    ROW0=0,
):
    """GROUPS > 1 (linear_groups): w's rows in GROUPS groups of N // GROUPS, group g reading x's
    columns [g·K, (g+1)·K) and stored as [M, N // GROUPS] at o + g·M·(N // GROUPS); a tile
    lies in one group. FP8: w holds e4m3 codes, row r's k block j scaled by
    s[(r + ROW0) // SBN, j] (row stride stride_sn; k blocks SBK long, 0: one), dequantized in
    registers (weight_tile)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    s_rows = rn
    if FP8:
        s_rows = scale_rows(s_ptr, 0, rn, N, 0, stride_sn, SBN, ROW0)
    if GROUPS > 1:
        group_n = N // GROUPS
        g = (pid_n * BLOCK_N) // group_n
        x_ptr += g * K
        o_ptr += g.to(tl.int64) * M * group_n - g * group_n
    if PREFETCH_K > 0:  # the weights need nothing from the kernel before
        if pid_m == 0:
            k_lo = 0
            k_end = K
            if SPLIT_GRID:
                k_lo = tl.program_id(2) * CHUNK
                k_end = tl.minimum(K, k_lo + CHUNK)
            prefetch_rows(
                w_ptr, rn, stride_wn, N, k_lo, tl.minimum(k_end, k_lo + PREFETCH_K), INTERP
            )
    after_prior(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    finish = True
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SPLIT_GRID:  # this program's chunk to the workspace; the tile's last arrival adds them
        s = tl.program_id(2)
        part = _chunk_product(
            x_ptr,
            w_ptr,
            rm,
            rn,
            M,
            N,
            s * CHUNK,
            tl.minimum(K, (s + 1) * CHUNK),
            stride_xm,
            stride_wn,
            IEEE,
            INTERP,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            s_rows,
            FP8,
            SBK,
        )
        ws = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
        live = (rm[:, None] < M) & (rn[None, :] < N)  # a one-row pass's 15 others: not written
        tl.store(ws + s.to(tl.int64) * ws_rows * N, part, mask=live)
        tile = pid_m * tl.num_programs(0) + pid_n
        finish = splitk.arrive(cnt_ptr, tile, SPLITS, INTERP)
        if finish:
            total = splitk.chunk_sum(total, ws, ws_rows * N, live, SPLITS)
            splitk.depart(cnt_ptr, tile)
    else:
        for t in tl.static_range(SPLITS):
            total += _chunk_product(
                x_ptr,
                w_ptr,
                rm,
                rn,
                M,
                N,
                t * CHUNK,
                tl.minimum(K, (t + 1) * CHUNK),
                stride_xm,
                stride_wn,
                IEEE,
                INTERP,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                s_rows,
                FP8,
                SBK,
            )
    if finish:  # rounded to x's dtype, then stored in out's (the same, or a wider float)
        out = total.to(x_ptr.dtype.element_ty)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
            out = (out.to(tl.float32) + bias.to(tl.float32)).to(x_ptr.dtype.element_ty)
        o_ptrs = o_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
        tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]ᵀ (+ bias [N]) -> [..., N] in x's dtype, stored in out_dtype
    (a float at least as wide: the logits as fp32 without a launch of their own)."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    _launch(rows, weight, bias, out, out.stride(0), 1)
    return out.reshape(*lead, n)


def _launch(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    stride_om: int,
    groups: int,
    scales: Fp8Scales | None = None,
) -> None:
    """rows [M, K] (unit column stride, any row stride) @ weight [N, K]ᵀ into out (row stride
    stride_om; with groups > 1, [groups, M, N // groups]): the tiles and K split of (N, K).
    scales: weight holds e4m3 codes with these scales (E 1; triton_fp8.linear_fp8)."""
    m, k = rows.shape[0], weight.shape[1]
    n = weight.shape[0]
    if not m:
        return
    bm, t = pick(m, n, k)
    splits = splits_of(n, k)
    chunk = splitk.chunk(k, t.block_k, splits)
    if scales is not None:
        t = fp8_tiles(m, n, k, chunk, t)
    grid_m = cdiv(m, bm)
    split_grid = splits > 1 and m <= SPLIT_ROWS
    grid = (cdiv(n, t.block_n), grid_m, splits if split_grid else 1)
    if split_grid:
        ws = torch.empty(splits, grid_m * bm, n, dtype=torch.float32, device=rows.device)
        cnt = splitk.counters(rows.device, grid[0] * grid[1])
    else:
        ws = cnt = out
    _linear_kernel[grid](
        rows,
        weight,
        bias if bias is not None else weight,
        out,
        ws,
        cnt,
        m,
        n,
        k,
        chunk,
        grid_m * bm,
        rows.stride(0),
        weight.stride(0),
        stride_om,
        HAS_BIAS=bias is not None,
        IEEE=rows.dtype == torch.float32,
        INTERP=interpreting(),
        SPLITS=splits,
        SPLIT_GRID=split_grid,
        BLOCK_M=bm,
        BLOCK_N=t.block_n,
        BLOCK_K=t.block_k,
        num_warps=t.warps,
        num_stages=t.stages,
        **launch_options(rows, dependent=scales is None),
        PREFETCH_K=prefetch_k(weight, n * splits),
        GROUPS=groups,
        **(_fp8_args(scales, k, t.block_k) if scales else {}),
    )


def _fp8_args(scales: Fp8Scales, k: int, block_k: int) -> dict:
    """_linear_kernel's fp8 arguments."""
    return dict(
        s_ptr=scales.scale,
        stride_sn=scales.scale.stride(1),
        SBN=scales.block_n,
        FP8=True,
        SBK=scales.kernel_block_k(k, block_k),
        ROW0=scales.row0,
    )


def groups_fit(n: int, k: int, groups: int) -> bool:
    """Whether linear_groups can take an [n, k] weight of `groups` groups in one launch: every
    tile it may use (any row count) lies in one group."""
    group_n = n // groups
    return n % groups == 0 and group_n % tiles_for(n, k).block_n == 0 and group_n % 128 == 0


def linear_groups(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [M, G·K] (unit column stride), weight [G·n, K] -> [G, M, n]: group g is
    x[:, g·K:(g+1)·K] @ weight[g·n:(g+1)·n]ᵀ, in x's dtype, the G products in one launch with
    the tiles and K split of the [G·n, K] weight (groups_fit must hold)."""
    m = x.shape[0]
    n, k = weight.shape
    if not groups_fit(n, k, groups) or x.shape[1] != groups * k:
        raise ValueError(
            f"linear_groups: x {tuple(x.shape)} and weight {tuple(weight.shape)} "
            f"in {groups} groups; needs x [M, {groups}·K] and rows a group a "
            "multiple of 128 and of the tile"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(groups, m, n // groups, dtype=x.dtype, device=x.device)
    _launch(x, weight, None, out, n // groups, groups)
    return out
