"""The expert GEMMs on the GPU in Triton, as ops/moe.py's `moe` and `gated_ffn` compute them.

- gate: per block of BLOCK_M pairs of one expert, act(x W1ᵀ) · (x W3ᵀ), rounded as the
  references round (each product to the model dtype, the activation in fp32 from the rounded
  product and rounded, then the product). act: "silu" (lfm2), "silu_clamp" (glm5_next:
  silu(min(h1, L)) · clamp(h3, -L, L), each clamp on the rounded product), "gelu_tanh" (gemma4).
- down: per block, y = g W2ᵀ rounded to the model dtype, times the route weight in fp32, kept
  in the slot's dtype: the model dtype (lfm2, glm5_next: rounded per slot) or fp32 (gemma4).
- slot sum: each row's slots summed in slot order in fp32, rounded once (lfm2, gemma4), or each
  add rounded to the model dtype (glm5_next); then an optional extra term (the shared expert).
W1 and W3 may be strided views of one fused [E, 2I, H] gate_up (gate_up[:, :I], gate_up[:, I:]).
A pair's result is computed with K walked in order in fixed BLOCK_K steps, so it does not
depend on how many rows share its expert; the M/N tile (BLOCK_M, BLOCK_N, warps) is chosen by
the pass's shape (a few rows, or a decode-sized pass of a few pairs an expert: 16-row tiles;
other decode-sized passes: 64-row tiles; prompt passes: 128-row tiles), which changes no
reduction order (every tile measured gave the same bits). Pairs come sorted by triton_align; the
grids are sized for the worst case, so a decode round's launches are fixed for its CUDA graph.
The dense FFN runs through the same kernels as one expert with every row a pair, on tiles of its
own where measured faster (DENSE_TILES), with its K in chunks (dense_splits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from . import triton_splitk as splitk
from .gpu import launch_options, prefetch_k
from .triton_align import Aligned, align
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

BLOCK_M = 128  # prompt passes (more than SMALL_ROWS rows)
SMALL_BLOCK_M = 64  # decode-sized passes
TINY_BLOCK_M = 16  # a few rows (TINY_ROWS or fewer)
TINY_ROWS = 16
SMALL_ROWS = 256


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    warps: int
    stages: int


# The fastest at 2048 rows of a tile sweep on an H200 (prompt passes), then a decode
# pass's and a few rows' (docs/performance.md, "MOE_TILES"). Every tile shape and BLOCK_M tried
# gave the same bits. All keep BLOCK_K 64: the k order.
SWIGLU_TILES = Tiles(128, 64, 8, 3)
DOWN_TILES = Tiles(128, 64, 8, 3)
SMALL_SWIGLU_TILES = Tiles(64, 64, 4, 4)
SMALL_DOWN_TILES = Tiles(64, 64, 4, 4)
TINY_SWIGLU_TILES = Tiles(32, 64, 2, 5)
TINY_DOWN_TILES = Tiles(32, 64, 2, 5)
# ... and a few rows' down kernel when its K (the experts' width) is LONG_K or more: 128-long k
# steps, 8 stages (docs/performance.md, "TINY_LONG_DOWN_TILES"). BLOCK_K 128 gives the bits of
# BLOCK_K 64 on the GPU, where the MMAs chain one accumulator in k steps of 16 whatever BLOCK_K
# is. The interpreter adds each dot's whole K to the accumulator at once, so there BLOCK_K
# stays 64.
TINY_LONG_DOWN_TILES = Tiles(32, 128, 4, 8)
LONG_K = 1024


# A decode-sized pass whose pairs come to at most FEW_PER_EXPERT an expert (many experts, a few
# pairs each) takes the few rows' blocks and tiles; the dense FFN stays on 64-row blocks
# (docs/performance.md, "FEW_PER_EXPERT"). Tiles change no bits.
FEW_PER_EXPERT = 8


# The dense FFN's tiles where measured faster than the experts' ((width, hidden, row class) ->
# (BLOCK_M, swiglu tiles, down tiles); the classes: "tiny", TINY_ROWS rows or fewer, "small", up
# to SMALL_ROWS; "walk", a prompt pass with its K split, whose two accumulators a product spill
# on the prompt tiles): a dense FFN is one expert, so the experts' tiles give it few programs
# (docs/performance.md, "DENSE_TILES"; every candidate's rows equal to a 2048-row pass's).
DENSE_TILES: dict[tuple[int, int, str], tuple[int, Tiles, Tiles]] = {
    (2112, 2816, "small"): (64, Tiles(16, 128, 4, 4), Tiles(32, 128, 4, 4)),
    (7168, 2048, "small"): (64, Tiles(64, 64, 4, 4), Tiles(16, 128, 4, 6)),
    (2112, 2816, "walk"): (128, Tiles(64, 128, 8, 3), Tiles(64, 64, 4, 3)),
    (7168, 2048, "walk"): (128, Tiles(64, 128, 8, 3), Tiles(128, 64, 8, 3)),
}


def _k64(t: Tiles) -> Tiles:
    """The interpreter's tiles: BLOCK_K 64, as the prompt tiles' (see TINY_LONG_DOWN_TILES)."""
    return Tiles(t.block_n, 64, t.warps, t.stages) if t.block_k != 64 else t


def _dense_class(rows: int, split: bool) -> str | None:
    """The DENSE_TILES row class of a dense FFN's pass (None: a prompt pass, unsplit)."""
    if rows <= TINY_ROWS:
        return "tiny"
    if rows <= SMALL_ROWS:
        return "small"
    return "walk" if split else None


def pick(
    rows: int,
    width: int = 0,
    pairs: int = 0,
    experts: int = 1,
    hidden: int = 0,
    split: bool = False,
) -> tuple[int, Tiles, Tiles]:
    """(BLOCK_M, swiglu tiles, down tiles) for a pass of `rows` rows through experts `width`
    wide (the down kernel's K) over `hidden` (the gate/up kernel's K; 0: not known); `pairs` (0:
    every row one pair, the dense FFN, its K split when `split`) over `experts`. From the pass's
    shape alone, never from which experts its rows chose."""
    cls = _dense_class(rows, split)
    if not pairs and experts == 1 and cls is not None:
        dense = DENSE_TILES.get((width, hidden, cls))
        if dense is not None:
            bm, sw, dn = dense
            return (bm, _k64(sw), _k64(dn)) if interpreting() else dense
    if rows <= TINY_ROWS:
        long_k = width >= LONG_K and not interpreting()
        return TINY_BLOCK_M, TINY_SWIGLU_TILES, TINY_LONG_DOWN_TILES if long_k else TINY_DOWN_TILES
    if rows <= SMALL_ROWS:
        if (pairs or rows) <= FEW_PER_EXPERT * experts:
            return TINY_BLOCK_M, TINY_SWIGLU_TILES, TINY_DOWN_TILES
        return SMALL_BLOCK_M, SMALL_SWIGLU_TILES, SMALL_DOWN_TILES
    return BLOCK_M, SWIGLU_TILES, DOWN_TILES


# fp8 weights' (swiglu, down) tiles on a few rows' 16-row blocks, where measured faster than the
# bf16 tiles (bench/fp8_kernels.py --tiles; none yet). BLOCK_K at most SPLIT_K_STEP and dividing
# it (the dense FFN's chunks, the 128-long scale blocks); it changes no bits on the GPU (as
# TINY_LONG_DOWN_TILES'); the interpreter keeps the bf16 tiles.
FP8_FEW_ROWS_TILES: tuple[Tiles, Tiles] | None = None


def fp8_tiles(block_m: int, sw: Tiles, dn: Tiles) -> tuple[Tiles, Tiles]:
    """The (swiglu, down) tiles of an fp8 pass on `block_m`-row blocks (pick's sw, dn)."""
    own = FP8_FEW_ROWS_TILES
    if own is None or block_m != TINY_BLOCK_M or interpreting():
        return sw, dn
    assert all(SPLIT_K_STEP % t.block_k == 0 for t in own), own
    return own


ACTS = {"silu": 0, "silu_clamp": 1, "gelu_tanh": 2}


@triton.jit
def _gate(h1, h3, limit, dt: tl.constexpr, ACT: tl.constexpr):
    """act(h1) · h3 -> dt. h1, h3: the products, already rounded to dt, in fp32."""
    if ACT == 1:
        h1 = tl.minimum(h1, limit).to(dt).to(tl.float32)
        h3 = tl.minimum(tl.maximum(h3, -limit), limit).to(dt).to(tl.float32)
    if ACT == 2:
        # 0.5·x·(1 + tanh(u)) == x·sigmoid(2u), u = √(2/π)·(x + 0.044715·x³)
        u = 0.7978845608028654 * (h1 + 0.044715 * (h1 * h1 * h1))
        act = h1 / (1.0 + tl.exp(-2.0 * u))
    else:
        act = h1 / (1.0 + tl.exp(-h1))
    return (act.to(dt).to(tl.float32) * h3).to(dt)


@triton.jit
def _gate_up_step(
    a, w1_ptrs, w3_ptrs, wmask, s1_rows, s3_rows, k0, acc1, acc3,
    dt: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, FP8: tl.constexpr,
    SBK: tl.constexpr,
):  # fmt: skip
    """One BK step of gate and up: the x tile `a` times w1's and w3's tiles at k0 (wmask: their
    valid rows and columns), added to acc1 and acc3."""
    b1 = weight_tile(w1_ptrs, wmask, s1_rows, k0, dt, FP8, SBK, INTERP)
    b3 = weight_tile(w3_ptrs, wmask, s3_rows, k0, dt, FP8, SBK, INTERP)
    return mma(a, b1, acc1, IEEE, INTERP), mma(a, b3, acc3, IEEE, INTERP)


@triton.jit
def _gate_up_chunk(
    x_ptr,
    w1_ptr,
    w3_ptr,
    src,
    valid,
    e64,
    rn,
    nmask,
    k_lo,
    k_hi,
    stride_xm,
    stride_1e,
    stride_1n,
    stride_3e,
    stride_3n,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    s1_rows,
    s3_rows,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
):
    """Σ over k in [k_lo, k_hi) of x[src, k] · w1[e, rn, k] and of · w3[e, rn, k], in BK
    steps from k_lo upward, each in one fp32 accumulator (FP8: the weights dequantized in
    registers, triton_util.weight_tile)."""
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + src[:, None] * stride_xm + (k_lo + rk)[None, :]
    w1_ptrs = w1_ptr + e64 * stride_1e + rn[None, :].to(tl.int64) * stride_1n + (k_lo + rk)[:, None]
    w3_ptrs = w3_ptr + e64 * stride_3e + rn[None, :].to(tl.int64) * stride_3n + (k_lo + rk)[:, None]
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kin = (k0 + rk) < k_hi
        a = tl.load(x_ptrs, mask=valid[:, None] & kin[None, :], other=0.0)
        acc1, acc3 = _gate_up_step(
            a, w1_ptrs, w3_ptrs, nmask & kin[:, None], s1_rows, s3_rows, k0, acc1, acc3,
            x_ptr.dtype.element_ty, IEEE, INTERP, FP8, SBK,
        )  # fmt: skip
        x_ptrs += BK
        w1_ptrs += BK
        w3_ptrs += BK
    return acc1, acc3


@triton.jit
def _down_chunk(
    g_ptr,
    w2_ptr,
    rows,
    valid,
    e64,
    rn,
    nmask,
    k_lo,
    k_hi,
    K,
    stride_2e,
    stride_2n,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    s_rows,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
):
    """Σ over k in [k_lo, k_hi) of g[rows, k] · w2[e, rn, k] (g's rows K long), in BK steps
    from k_lo upward, in one fp32 accumulator (FP8: w2 dequantized in registers)."""
    rk = tl.arange(0, BK)
    g_ptrs = g_ptr + rows[:, None] * K + (k_lo + rk)[None, :]
    w_ptrs = w2_ptr + e64 * stride_2e + rn[None, :].to(tl.int64) * stride_2n + (k_lo + rk)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kin = (k0 + rk) < k_hi
        a = tl.load(g_ptrs, mask=valid[:, None] & kin[None, :], other=0.0)
        b = weight_tile(
            w_ptrs, nmask & kin[:, None], s_rows, k0, g_ptr.dtype.element_ty, FP8, SBK, INTERP
        )
        acc = mma(a, b, acc, IEEE, INTERP)
        g_ptrs += BK
        w_ptrs += BK
    return acc


@triton.jit
def _chunk_end(k0, k_end, CHUNK, BK: tl.constexpr):
    """Whether the BK step at k0 is its chunk's last (the chunk's or K's end)."""
    return ((k0 + BK) % CHUNK == 0) | (k0 + BK >= k_end)


@triton.jit
def _gate_up_walk(
    x_ptr,
    w1_ptr,
    w3_ptr,
    src,
    valid,
    e64,
    rn,
    nmask,
    k_end,
    CHUNK,
    stride_xm,
    stride_1e,
    stride_1n,
    stride_3e,
    stride_3n,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    s1_rows,
    s3_rows,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
):
    """_gate_up_chunk over each chunk of CHUNK in [0, k_end), the chunks' sums added from +0 in
    chunk order: the same operations as a loop a chunk, in one loop (one pipeline): a chunk's
    accumulators restart from zero at its end. No chunk may be empty (_split_args)."""
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + src[:, None] * stride_xm + rk[None, :]
    w1_ptrs = w1_ptr + e64 * stride_1e + rn[None, :].to(tl.int64) * stride_1n + rk[:, None]
    w3_ptrs = w3_ptr + e64 * stride_3e + rn[None, :].to(tl.int64) * stride_3n + rk[:, None]
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    tot1 = tl.zeros((BM, BN), dtype=tl.float32)
    tot3 = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        kin = (k0 + rk) < k_end
        a = tl.load(x_ptrs, mask=valid[:, None] & kin[None, :], other=0.0)
        acc1, acc3 = _gate_up_step(
            a, w1_ptrs, w3_ptrs, nmask & kin[:, None], s1_rows, s3_rows, k0, acc1, acc3,
            x_ptr.dtype.element_ty, IEEE, INTERP, FP8, SBK,
        )  # fmt: skip
        end = _chunk_end(k0, k_end, CHUNK, BK)
        tot1 = tl.where(end, tot1 + acc1, tot1)
        tot3 = tl.where(end, tot3 + acc3, tot3)
        acc1 = tl.where(end, 0.0, acc1)
        acc3 = tl.where(end, 0.0, acc3)
        x_ptrs += BK
        w1_ptrs += BK
        w3_ptrs += BK
    return tot1, tot3


@triton.jit
def _down_walk(
    g_ptr,
    w2_ptr,
    rows,
    valid,
    e64,
    rn,
    nmask,
    k_end,
    CHUNK,
    K,
    stride_2e,
    stride_2n,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    s_rows,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
):
    """_down_chunk over each chunk of CHUNK in [0, k_end), summed as _gate_up_walk sums."""
    rk = tl.arange(0, BK)
    g_ptrs = g_ptr + rows[:, None] * K + rk[None, :]
    w_ptrs = w2_ptr + e64 * stride_2e + rn[None, :].to(tl.int64) * stride_2n + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    tot = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, k_end, BK):
        kin = (k0 + rk) < k_end
        a = tl.load(g_ptrs, mask=valid[:, None] & kin[None, :], other=0.0)
        b = weight_tile(
            w_ptrs, nmask & kin[:, None], s_rows, k0, g_ptr.dtype.element_ty, FP8, SBK, INTERP
        )
        acc = mma(a, b, acc, IEEE, INTERP)
        end = _chunk_end(k0, k_end, CHUNK, BK)
        tot = tl.where(end, tot + acc, tot)
        acc = tl.where(end, 0.0, acc)
        g_ptrs += BK
        w_ptrs += BK
    return tot


@triton.jit(do_not_specialize=["P"])  # one binary for any row count
def _swiglu_kernel(
    # I: the intermediate size, the letter of the shapes in this module's docstrings
    x_ptr,
    w1_ptr,
    w3_ptr,
    g_ptr,
    ex_ptr,
    sorted_ptr,
    block_ptr,
    P,
    E,
    I,  # noqa: E741
    K,
    limit,
    stride_xm,
    stride_1e,
    stride_1n,
    stride_3e,
    stride_3n,
    TOPK: tl.constexpr,
    ACT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,
    ws_ptr=None,
    cnt_ptr=None,
    CHUNK=0,
    ws_rows=0,
    SPLITS: tl.constexpr = 1,
    SPLIT_GRID: tl.constexpr = False,
    s1_ptr=None,
    s3_ptr=None,
    stride_s1e=0,
    stride_s1n=0,
    stride_s3e=0,
    stride_s3n=0,
    SBN=1,
    FP8: tl.constexpr = False,
    SBK: tl.constexpr = 0,
    ROW0_1=0,
    ROW0_3=0,
):
    """SPLITS > 1 (the dense FFN, dense_splits): K in SPLITS chunks of CHUNK, each product's
    chunks summed in chunk order: by one program (a prompt pass), or (SPLIT_GRID) a program
    a chunk (grid axis 2) whose partials go to ws [SPLITS, 2, ws_rows, I] fp32 and the tile's
    last to arrive adds them up (triton_splitk's order). FP8: w1 and w3 hold e4m3 codes, row r
    of expert e in k block j scaled by s[e, (r + ROW0) // SBN, j] (ROW0_1 for w1, ROW0_3 for
    w3: a fused gate/up's up half may start inside a block; k blocks SBK long, 0: one),
    dequantized in registers (triton_util.weight_tile)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    if PREFETCH_K > 0:  # pair pid_m's expert rows (Aligned.pair_expert)
        if pid_m < P:
            ep = tl.minimum(tl.maximum(tl.load(ex_ptr + pid_m), 0), E - 1).to(tl.int64)
            k_hi = tl.minimum(K, PREFETCH_K)
            prefetch_rows(w1_ptr + ep * stride_1e, rn, stride_1n, I, 0, k_hi, INTERP)
            prefetch_rows(w3_ptr + ep * stride_3e, rn, stride_3n, I, 0, k_hi, INTERP)
    after_prior(PDL)
    e = tl.load(block_ptr + pid_m)
    live = e < E
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = (pairs < P) & live
    src = (pairs // TOPK).to(tl.int64)
    e64 = tl.where(live, e, 0).to(tl.int64)
    k_end = tl.where(live, K, 0)
    nmask = rn[None, :] < I
    s1_rows = rn
    s3_rows = rn
    if FP8:
        s1_rows = scale_rows(s1_ptr, e64, rn, I, stride_s1e, stride_s1n, SBN, ROW0_1)
        s3_rows = scale_rows(s3_ptr, e64, rn, I, stride_s3e, stride_s3n, SBN, ROW0_3)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    finish = True
    if SPLITS == 1:
        acc1, acc3 = _gate_up_chunk(
            x_ptr,
            w1_ptr,
            w3_ptr,
            src,
            valid,
            e64,
            rn,
            nmask,
            0,
            k_end,
            stride_xm,
            stride_1e,
            stride_1n,
            stride_3e,
            stride_3n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s1_rows,
            s3_rows,
            FP8,
            SBK,
        )
    elif SPLIT_GRID:
        sp = tl.program_id(2)
        p1, p3 = _gate_up_chunk(
            x_ptr,
            w1_ptr,
            w3_ptr,
            src,
            valid,
            e64,
            rn,
            nmask,
            sp * CHUNK,
            tl.minimum(k_end, (sp + 1) * CHUNK),
            stride_xm,
            stride_1e,
            stride_1n,
            stride_3e,
            stride_3n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s1_rows,
            s3_rows,
            FP8,
            SBK,
        )
        live_ws = valid[:, None] & nmask
        ws = ws_ptr + rows[:, None] * I + rn[None, :]
        half = ws_rows * I
        tl.store(ws + sp.to(tl.int64) * 2 * half, p1, mask=live_ws)
        tl.store(ws + sp.to(tl.int64) * 2 * half + half, p3, mask=live_ws)
        tile = pid_m * tl.num_programs(0) + pid_n
        finish = splitk.arrive(cnt_ptr, tile, SPLITS, INTERP)
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        if finish:
            acc1 = splitk.chunk_sum(acc1, ws, 2 * half, live_ws, SPLITS)
            acc3 = splitk.chunk_sum(acc3, ws + half, 2 * half, live_ws, SPLITS)
            splitk.depart(cnt_ptr, tile)
    else:  # one program walks the chunks in one loop (one pipeline)
        acc1, acc3 = _gate_up_walk(
            x_ptr,
            w1_ptr,
            w3_ptr,
            src,
            valid,
            e64,
            rn,
            nmask,
            k_end,
            CHUNK,
            stride_xm,
            stride_1e,
            stride_1n,
            stride_3e,
            stride_3n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s1_rows,
            s3_rows,
            FP8,
            SBK,
        )
    if finish:
        dt = g_ptr.dtype.element_ty
        g = _gate(acc1.to(dt).to(tl.float32), acc3.to(dt).to(tl.float32), limit, dt, ACT)
        tl.store(g_ptr + rows[:, None] * I + rn[None, :], g, mask=valid[:, None] & nmask)


@triton.jit(do_not_specialize=["P"])  # one binary for any row count
def _down_kernel(
    g_ptr,
    w2_ptr,
    rw_ptr,
    out_ptr,
    sorted_ptr,
    block_ptr,
    P,
    E,
    H,
    K,
    stride_2e,
    stride_2n,
    stride_om,
    HAS_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,
    ws_ptr=None,
    cnt_ptr=None,
    CHUNK=0,
    ws_rows=0,
    SPLITS: tl.constexpr = 1,
    SPLIT_GRID: tl.constexpr = False,
    s2_ptr=None,
    stride_s2e=0,
    stride_s2n=0,
    SBN=1,
    FP8: tl.constexpr = False,
    SBK: tl.constexpr = 0,
    ROW0=0,
):
    """SPLITS > 1: as _swiglu_kernel's, with ws [SPLITS, ws_rows, H] fp32. FP8: as
    _swiglu_kernel's, for w2 (ROW0 its row offset)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    if PREFETCH_K > 0:  # align wrote the block map two kernels back (swiglu between)
        ep = tl.load(block_ptr + pid_m)
        if ep < E:
            prefetch_rows(
                w2_ptr + tl.maximum(ep, 0).to(tl.int64) * stride_2e,
                rn,
                stride_2n,
                H,
                0,
                tl.minimum(K, PREFETCH_K),
                INTERP,
            )
    after_prior(PDL)
    e = tl.load(block_ptr + pid_m)
    live = e < E
    pairs = tl.load(sorted_ptr + pid_m * BM + tl.arange(0, BM))
    valid = (pairs < P) & live
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    e64 = tl.where(live, e, 0).to(tl.int64)
    k_end = tl.where(live, K, 0)
    nmask = rn[None, :] < H
    s_rows = rn
    if FP8:
        s_rows = scale_rows(s2_ptr, e64, rn, H, stride_s2e, stride_s2n, SBN, ROW0)
    finish = True
    if SPLITS == 1:
        acc = _down_chunk(
            g_ptr,
            w2_ptr,
            rows,
            valid,
            e64,
            rn,
            nmask,
            0,
            k_end,
            K,
            stride_2e,
            stride_2n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s_rows,
            FP8,
            SBK,
        )
    elif SPLIT_GRID:
        sp = tl.program_id(2)
        part = _down_chunk(
            g_ptr,
            w2_ptr,
            rows,
            valid,
            e64,
            rn,
            nmask,
            sp * CHUNK,
            tl.minimum(k_end, (sp + 1) * CHUNK),
            K,
            stride_2e,
            stride_2n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s_rows,
            FP8,
            SBK,
        )
        live_ws = valid[:, None] & nmask
        ws = ws_ptr + rows[:, None] * H + rn[None, :]
        tl.store(ws + sp.to(tl.int64) * ws_rows * H, part, mask=live_ws)
        tile = pid_m * tl.num_programs(0) + pid_n
        finish = splitk.arrive(cnt_ptr, tile, SPLITS, INTERP)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if finish:
            acc = splitk.chunk_sum(acc, ws, ws_rows * H, live_ws, SPLITS)
            splitk.depart(cnt_ptr, tile)
    else:  # one program walks the chunks in one loop (one pipeline)
        acc = _down_walk(
            g_ptr,
            w2_ptr,
            rows,
            valid,
            e64,
            rn,
            nmask,
            k_end,
            CHUNK,
            K,
            stride_2e,
            stride_2n,
            IEEE,
            INTERP,
            BM,
            BN,
            BK,
            s_rows,
            FP8,
            SBK,
        )
    if finish:
        y = acc.to(g_ptr.dtype.element_ty)  # the expert's output in the model dtype
        if HAS_WEIGHT:
            rw = tl.load(rw_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
            y = y.to(tl.float32) * rw[:, None]
        y = y.to(out_ptr.dtype.element_ty)  # the slot's dtype
        dest = pairs.to(tl.int64)
        tl.store(out_ptr + dest[:, None] * stride_om + rn[None, :], y, mask=valid[:, None] & nmask)


@triton.jit
def _slot_sum_kernel(
    s_ptr,
    p_ptr,
    o_ptr,
    H,
    TOPK: tl.constexpr,
    CH: tl.constexpr,
    ROUND_EACH: tl.constexpr,
    HAS_PLUS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * CH + tl.arange(0, CH)
    m = ch < H
    dt = o_ptr.dtype.element_ty
    acc = tl.load(s_ptr + (row * TOPK) * H + ch, mask=m, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc = acc + tl.load(s_ptr + (row * TOPK + j) * H + ch, mask=m, other=0.0).to(tl.float32)
        if ROUND_EACH:
            acc = acc.to(dt).to(tl.float32)
    if HAS_PLUS:
        acc = acc + tl.load(p_ptr + row * H + ch, mask=m, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * H + ch, acc.to(dt), mask=m)


def stacked(ws: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """E x [A, B] -> [E, A, B]: a tensor as is; a list as stack() makes it (no copy when the
    experts are evenly spaced views of one storage, as the loaders and dummy loaders make them).
    Nothing is kept: a cache here would hold a freed model's experts."""
    return ws if isinstance(ws, torch.Tensor) else stack(ws)


def stack(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """E x [A, B] -> [E, A, B]: a strided view when the experts are evenly spaced views of one
    storage, else a stacked copy (not kept)."""
    first = ws[0]
    step = ws[1].storage_offset() - first.storage_offset() if len(ws) > 1 else 0
    even = all(
        w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and w.stride() == first.stride()
        and w.shape == first.shape
        and w.storage_offset() == first.storage_offset() + i * step
        for i, w in enumerate(ws)
    )
    if even and first.stride(-1) == 1:
        return first.as_strided((len(ws), *first.shape), (step, *first.stride()))
    return torch.stack(list(ws))


# The dense FFN's products with K cut into chunks summed in chunk order, as triton_linear's (the
# split from the product's shape alone, so every pass sums a row the same way): a dense FFN is one
# expert, whose tiles alone give a one-row pass few programs (gemma4's 2112 x 2816 gate/up: 66).
# Passes of up to DENSE_SPLIT_ROWS rows run a program a chunk, larger ones walk the chunks in one
# loop, a chunk's accumulators restarting from zero at its end (docs/performance.md,
# "DENSE_SPLIT" and "DENSE_WALK"). The chunks are whole multiples of SPLIT_K_STEP, so BLOCK_K 64
# and 128 both walk them whole.
DENSE_WAVE = 256  # programs a one-row pass's product should offer
DENSE_SPLIT_COLUMNS = 32  # the output columns a program is counted for (fixed: it sets the split)
SPLIT_K_STEP = 128
DENSE_SPLIT_ROWS = TINY_ROWS


def dense_splits(n: int, k: int) -> int:
    """K chunks for a dense FFN product of n outputs over k (1: unsplit, the experts' order)."""
    splits = splitk.splits_for(cdiv(n, DENSE_SPLIT_COLUMNS), cdiv(k, SPLIT_K_STEP), DENSE_WAVE)
    while splits > 1 and (splits - 1) * splitk.chunk(k, SPLIT_K_STEP, splits) >= k:
        splits //= 2  # no empty chunk (9 steps in 8 chunks of 2 would leave three)
    return splits


def _split_args(
    splits: int,
    pairs: int,
    tiles: int,
    rows: int,
    width: int,
    k: int,
    t: Tiles,
    halves: int,
    device: torch.device,
) -> tuple[dict, int]:
    """The split's kernel arguments and grid axis 2 for a product over k: none when unsplit."""
    if splits == 1:
        return {}, 1
    chunk = splitk.chunk(k, SPLIT_K_STEP, splits)
    assert chunk % t.block_k == 0, (chunk, t)
    assert (splits - 1) * chunk < k, (k, splits, chunk)  # no empty chunk (_gate_up_walk)
    if pairs > DENSE_SPLIT_ROWS:  # one program walks a tile's chunks: no workspace
        return dict(CHUNK=chunk, SPLITS=splits), 1
    ws = torch.empty(splits * halves * rows * width, dtype=torch.float32, device=device)
    return dict(
        ws_ptr=ws,
        cnt_ptr=splitk.counters(device, tiles),
        CHUNK=chunk,
        ws_rows=rows,
        SPLITS=splits,
        SPLIT_GRID=True,
    ), splits


def _experts(
    x: torch.Tensor,
    al: Aligned,
    pairs: int,
    top_k: int,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    route_weights: torch.Tensor | None,
    out: torch.Tensor,
    block_m: int,
    sw: Tiles,
    dn: Tiles,
    act: str,
    limit: float,
    splits: tuple[int, int] = (1, 1),
    scales: tuple[Fp8Scales, Fp8Scales, Fp8Scales] | None = None,
) -> None:
    """x [N, H]; w1, w3 [E, I, H]; w2 [E, H, I] (each row contiguous; any strides between rows
    and experts); out [pairs, H] gets each pair's output, in out's dtype. splits: the gate/up
    and the down products' K chunks (dense_splits). scales: the weights are e4m3 codes, with
    these scales (w1's and w3's of one block shape)."""
    e, i, h = w1.shape
    assert w3.shape == w1.shape and w2.shape == (e, h, i)
    assert w1.stride(-1) == 1 and w3.stride(-1) == 1 and w2.stride(-1) == 1
    x = x.contiguous()
    rows = al.max_blocks * block_m
    g = torch.empty(rows, i, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32
    # Weights prefetched before each kernel's wait: a few rows' passes (decode), bounded by
    # the experts a launch can read.
    ex = min(e, al.max_blocks) if block_m == TINY_BLOCK_M else 0
    pre_sw = min(prefetch_k(w1, 2 * i * ex), prefetch_k(w3, 2 * i * ex)) if ex else 0
    t = sw
    tiles = (cdiv(i, t.block_n), al.max_blocks)
    split, axis = _split_args(splits[0], pairs, tiles[0] * tiles[1], rows, i, h, t, 2, x.device)
    _swiglu_kernel[(*tiles, axis)](
        x,
        w1,
        w3,
        g,
        al.pair_expert,
        al.sorted_pairs,
        al.block_expert,
        pairs,
        e,
        i,
        h,
        float(limit),
        x.stride(0),
        w1.stride(0),
        w1.stride(1),
        w3.stride(0),
        w3.stride(1),
        TOPK=top_k,
        ACT=ACTS[act],
        IEEE=ieee,
        INTERP=interpreting(),
        BM=block_m,
        BN=t.block_n,
        BK=t.block_k,
        num_warps=t.warps,
        num_stages=t.stages,
        **launch_options(x, dependent=scales is None),
        PREFETCH_K=pre_sw,
        **split,
        **(_gate_up_scales(scales[0], scales[1], h, t) if scales else {}),
    )
    t = dn
    rw = route_weights.reshape(-1) if route_weights is not None else g
    tiles = (cdiv(h, t.block_n), al.max_blocks)
    split, axis = _split_args(splits[1], pairs, tiles[0] * tiles[1], rows, h, i, t, 1, x.device)
    _down_kernel[(*tiles, axis)](
        g,
        w2,
        rw,
        out,
        al.sorted_pairs,
        al.block_expert,
        pairs,
        e,
        h,
        i,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        HAS_WEIGHT=route_weights is not None,
        IEEE=ieee,
        INTERP=interpreting(),
        BM=block_m,
        BN=t.block_n,
        BK=t.block_k,
        num_warps=t.warps,
        num_stages=t.stages,
        **launch_options(g, dependent=scales is None),
        PREFETCH_K=prefetch_k(w2, h * ex) if ex else 0,
        **split,
        **(_down_scales(scales[2], i, t) if scales else {}),
    )


def _gate_up_scales(s1: Fp8Scales, s3: Fp8Scales, k: int, t: Tiles) -> dict:
    """_swiglu_kernel's fp8 arguments."""
    assert (s1.block_n, s1.block_k) == (s3.block_n, s3.block_k)
    return dict(
        s1_ptr=s1.scale,
        s3_ptr=s3.scale,
        stride_s1e=s1.scale.stride(0),
        stride_s1n=s1.scale.stride(1),
        stride_s3e=s3.scale.stride(0),
        stride_s3n=s3.scale.stride(1),
        SBN=s1.block_n,
        FP8=True,
        SBK=s1.kernel_block_k(k, t.block_k),
        ROW0_1=s1.row0,
        ROW0_3=s3.row0,
    )


def _down_scales(s2: Fp8Scales, k: int, t: Tiles) -> dict:
    """_down_kernel's fp8 arguments."""
    return dict(
        s2_ptr=s2.scale,
        stride_s2e=s2.scale.stride(0),
        stride_s2n=s2.scale.stride(1),
        SBN=s2.block_n,
        FP8=True,
        SBK=s2.kernel_block_k(k, t.block_k),
        ROW0=s2.row0,
    )


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Sequence[torch.Tensor] | torch.Tensor,
    w3: Sequence[torch.Tensor] | torch.Tensor,
    w2: Sequence[torch.Tensor] | torch.Tensor,
    *,
    act: str = "silu",
    limit: float = 0.0,
    slot_dtype: torch.dtype | None = None,
    round_sum: bool = False,
    plus: torch.Tensor | None = None,
    sum_slots: bool = True,
    scales: tuple[Fp8Scales, Fp8Scales, Fp8Scales] | None = None,
) -> torch.Tensor:
    """x [N, H]; weights [N, k] (any float dtype); experts [N, k]; w1, w3 E x [I, H] or
    [E, I, H]; w2 E x [H, I] or [E, H, I] -> Σ_j weights[:, j] · expert_j(x) [N, H], in slot
    order. slot_dtype: each slot's y·w is kept in it (default x's dtype; torch.float32 keeps the
    products unrounded). round_sum: each add of the slot sum rounded to x's dtype, else summed in
    fp32. plus [N, H]: added last (before the final rounding). sum_slots=False: the slots
    [N, k, H] as they are (their sum left to the caller: slot_sum, or add_rms_norm's).
    scales: w1, w3, w2 are [E, ·, ·] e4m3 codes with these scales (triton_fp8.moe_fp8)."""
    n, k = experts.shape
    s1, s3, s2 = stacked(w1), stacked(w3), stacked(w2)
    bm, sw, dn = pick(n, s1.shape[1], n * k, s1.shape[0])
    if scales is not None:
        sw, dn = fp8_tiles(bm, sw, dn)
    al = prealigned(experts, s1.shape[0], bm) or align(experts, s1.shape[0], bm)
    h = x.shape[1]
    slots = torch.empty(n * k, h, dtype=slot_dtype or x.dtype, device=x.device)
    if n:
        _experts(
            x,
            al,
            n * k,
            k,
            s1,
            s3,
            s2,
            weights.contiguous(),
            slots,
            bm,
            sw,
            dn,
            act,
            limit,
            scales=scales,
        )
    if not sum_slots:
        return slots.view(n, k, h)
    return slot_sum(slots.view(n, k, h), x.dtype, round_sum, plus)


def slot_sum(
    slots: torch.Tensor,
    dtype: torch.dtype | None = None,
    round_each: bool = False,
    plus: torch.Tensor | None = None,
) -> torch.Tensor:
    """slots [N, k, H] -> Σ_j slots[:, j] in slot order in fp32 (round_each: each add rounded to
    dtype), plus [N, H] added last, rounded to dtype (default: the slots')."""
    n, k, h = slots.shape
    slots = slots.contiguous()
    out = torch.empty(n, h, dtype=dtype or slots.dtype, device=slots.device)
    if n:
        p = plus.contiguous() if plus is not None else out
        assert p.shape == out.shape
        _slot_sum_kernel[(n, cdiv(h, 1024))](
            slots,
            p,
            out,
            h,
            TOPK=k,
            CH=1024,
            ROUND_EACH=round_each,
            HAS_PLUS=plus is not None,
            num_warps=4,
            **launch_options(slots),
        )
    return out


def prealigned(experts: torch.Tensor, num_experts: int, block_m: int) -> Aligned | None:
    """The pairs' order the router left with `experts` (triton_route, a pass of one row), when
    it was sorted for these experts and this block size; else None (align sorts them)."""
    al = getattr(experts, "tf_aligned", None)
    if al is not None and al.block_m == block_m and al.num_experts == num_experts:
        return al
    return None


def gated_ffn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    *,
    act: str = "silu",
    limit: float = 0.0,
    scales: tuple[Fp8Scales, Fp8Scales, Fp8Scales] | None = None,
) -> torch.Tensor:
    """The dense gated FFN through the same kernels, every row one pair of one expert.
    x [N, H]; w1, w3 [I, H] (views of a fused [2I, H] are fine); w2 [H, I] -> [N, H].
    scales: the weights are e4m3 codes with these scales, each [1, ·, ·] (triton_fp8)."""
    n, h = x.shape
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    i = w1.shape[0]
    splits = (dense_splits(i, h), dense_splits(h, i))
    bm, sw, dn = pick(n, i, hidden=h, split=max(splits) > 1)
    if scales is not None:
        sw, dn = fp8_tiles(bm, sw, dn)
    _experts(
        x,
        _identity(n, x.device, bm),
        n,
        1,
        w1[None],
        w3[None],
        w2[None],
        None,
        out,
        bm,
        sw,
        dn,
        act,
        limit,
        splits,
        scales,
    )
    return out


def _identity(n: int, device: torch.device, block_m: int) -> Aligned:
    """Rows 0..n-1 in order, all of expert 0 (the dense FFN); built once a row count."""
    key = (n, str(device), block_m)
    if key not in _IDENTITY:
        blocks = cdiv(n, block_m)
        pairs = torch.arange(blocks * block_m, dtype=torch.int32, device=device)
        pairs = torch.where(pairs < n, pairs, n)
        zeros = torch.zeros(blocks, dtype=torch.int32, device=device)
        _IDENTITY[key] = Aligned(pairs, zeros, blocks, zeros)
    return _IDENTITY[key]


_IDENTITY: dict[tuple[int, str, int], Aligned] = {}
