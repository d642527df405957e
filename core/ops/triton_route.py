"""Top-k routing on the GPU in Triton, as the references compute it.

- `route`: sigmoid scores, top k by score + bias, renormalised, times a scaling: ops/moe.py's
  `route` (lfm2: logits, scores and weights in the model dtype), and glm5_next's router
  (`fp32=True`: all in fp32, +1e-20 in the renorm, expert groups, slots in expert order).
- `softmax_route`: softmax scores in fp32, top k, renormalised, times a per-expert scale
  (gemma4), and `router_input`, gemma4's router input and experts' input from the residual.

The router GEMV is split over fixed chunks of H (a program a chunk and a block of experts: a few
rows would otherwise wait on one long loop); then one program per few rows sums the chunks in
order, rounds the logits as the reference does, scores them, picks the top k (ties to the lower
expert) and renormalises the weights in slot order. The chunks and the tiles depend on H and E
alone, so a row's result never depends on the other rows; nothing reads a device value on the
host, so a decode round's routing is captured in its CUDA graph.

An fp32 router whose gate is stored transposed (`gate` [E, H] a view of a contiguous [H, E]:
`columns_major`) takes `_router_chain_kernel` instead: each logit of a chunk is one chain of FMAs
down its FP32_CHAIN_SPLIT columns of H, in order, each step reading E contiguous fp32 of the
gate. An FMA chain has the same bits on a tile of one row or of many, so a one-row pass runs on
a one-row tile; a decode-sized pass runs a program a chunk, the chunks added in order by the
last program of each expert block to arrive (triton_splitk's counters), a prompt's programs
walk the chunks in the same order. glm5_next keeps its gate row-major (docs/performance.md,
"FP32_CHAIN_SUMS").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import switches, triton_splitk
from .gpu import launch_options
from .triton_align import Aligned, align_pairs, max_blocks_for
from .triton_moe import TINY_BLOCK_M, TINY_ROWS
from .triton_norms import NORM_WARPS, norm_rows, rows_per_program
from .triton_util import after_prior, cdiv, interpreting, mma, next_power_of_2, publish_writes

ROUTE_ROWS = 16
# A pass of one row, or of a few that one route program holds (up to ROUTE_ROWS and the expert
# GEMMs' TINY_ROWS) with the pairs' one-hot against the experts within FEW_ROWS_ONE_HOT
# elements, has its pairs aligned by its route program, not align's launch
# (docs/performance.md, "ALIGN_ONE_ROW" and "ALIGN_FEW_ROWS").
FEW_ROWS_ONE_HOT = 1024
# A one-row pass routes in one launch (partials and top k; its add + RMSNorm too, norm_route)
# for up to this many experts (docs/performance.md, "FUSE_ONE_ROW" and "NORM_IN_ROUTER").
FUSE_MAX_EXPERTS = 64
# A route without expert groups runs a program a row on a [1, E] tile (one warp; the one-launch
# sigmoid router in its four warps) wherever one program does not align the whole pass: a row's
# reductions keep the [ROUTE_ROWS, E] tile's layout, so its bits (docs/performance.md,
# "ONE_ROW_TILE" and "ONE_ROW_PROGRAMS"). A route program's K splits are summed by an unrolled
# loop (the same sums in the same order) and a few pairs are aligned against each other
# (triton_align's _align_pairwise; docs/performance.md, "UNROLL_SPLITS and PAIRWISE_ALIGN").
SIGMOID_ONE_ROW_WARPS = 1  # warps of a one-row sigmoid route (no sum a layout orders)
FUSE_MAX_SIGMOID_EXPERTS = 64  # FUSE_MAX_EXPERTS for sigmoid routing without expert groups
ROUTER_SPLIT = 256  # columns of H a router program sums (fixed: part of the reduction order)
EXPERT_BLOCK = 64  # experts a router program computes
# Experts a program of an fp32 router (glm5_next) computes; the tile along the experts never
# changes a logit's k order (docs/performance.md, "FP32_EXPERT_BLOCK").
FP32_EXPERT_BLOCK = 64
# The chain kernel's chunk of H (fixed: part of the reduction order) and its experts a program
# (bench/experiments/glm_one_program.py's ROUTE_WAYS hold the others; docs/performance.md, "FP32_CHAIN_SUMS").
FP32_CHAIN_SPLIT = 64
FP32_CHAIN_EXPERTS = 64
FP32_CHAIN_ROWS = 16  # rows a chain program takes in a pass of more than one row (any: no bits)
FP32_CHAIN_SPLIT_ROWS = 16  # passes of up to this many rows: a program a chunk


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _router_partial_kernel(
    x_ptr,
    g_ptr,
    part_ptr,
    M,
    E,
    K,
    stride_xm,
    F32: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    EB: tl.constexpr,
    EBLK: tl.constexpr,
    KS: tl.constexpr,
    BK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    _router_partial(
        x_ptr, g_ptr, part_ptr, M, E, K, stride_xm, F32, IEEE, INTERP, BM, EB, EBLK, KS, BK
    )


@triton.jit
def _router_partial(
    x_ptr,
    g_ptr,
    part_ptr,
    M,
    E,
    K,
    stride_xm,
    F32: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    BM: tl.constexpr,
    EB: tl.constexpr,
    EBLK: tl.constexpr,
    KS: tl.constexpr,
    BK: tl.constexpr,
):
    """Split s of the router logits: x[:, s*KS : (s+1)*KS] @ gate[experts of this block, same]ᵀ,
    fp32 (F32: x read as fp32, an fp32 product, as x.float() @ gate.float()ᵀ)."""
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    re = tl.program_id(2) * EBLK + tl.arange(0, EBLK)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, EBLK), dtype=tl.float32)
    for k0 in tl.static_range(0, KS, BK):
        kk = s * KS + k0 + rk
        kin = kk < K
        a = tl.load(
            x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
            mask=(rm[:, None] < M) & kin[None, :],
            other=0.0,
        )
        b = tl.load(
            g_ptr + re[None, :].to(tl.int64) * K + kk[:, None],
            mask=(re[None, :] < E) & kin[:, None],
            other=0.0,
        )
        if F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = mma(a, b, acc, IEEE, INTERP)
    offs = (s * M + rm)[:, None].to(tl.int64) * EB + re[None, :]
    tl.store(part_ptr + offs, acc, mask=rm[:, None] < M)


@triton.jit
def _chain_chunk(
    x_rows,
    rmask,
    gt_ptr,
    re,
    emask,
    E,
    K,
    k0,
    BM: tl.constexpr,
    EBLK: tl.constexpr,
    KS: tl.constexpr,
):
    """x[rows, k0 : k0+KS] @ gt[same, re]: each logit one FMA chain over the chunk's columns in
    order, from 0. -> [BM, EBLK] fp32."""
    acc = tl.zeros((BM, EBLK), dtype=tl.float32)
    for j in tl.static_range(KS):  # unrolled: the chunk's loads in flight together
        k = k0 + j
        a = tl.load(x_rows + k, mask=rmask & (k < K), other=0.0).to(tl.float32)
        b = tl.load(gt_ptr + k.to(tl.int64) * E + re, mask=emask & (k < K), other=0.0)
        acc = tl.fma(a[:, None], b[None, :], acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _router_chain_kernel(
    x_ptr,
    gt_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    E,
    K,
    stride_xm,
    ws_rows,
    EB: tl.constexpr,
    BM: tl.constexpr,
    EBLK: tl.constexpr,
    KS: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLIT_GRID: tl.constexpr,
    SUM: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The fp32 router's logits x @ gt in SPLITS chunks of KS columns of K (gt [K, E] fp32
    contiguous: the gate transposed), each chunk's logit an FMA chain (_chain_chunk), the
    chunks added in order from +0. SPLIT_GRID: a program a chunk (program_id 1), its partial
    to ws [SPLITS, ws_rows, EB]; with SUM the block's last program to arrive adds them up and
    stores the logits to out [M, EB]; without, the partials are the output (out unused: a
    route kernel sums them). Otherwise a program walks the chunks in order itself."""
    after_prior(PDL)
    pid_m = tl.program_id(0)
    pid_e = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    re = pid_e * EBLK + tl.arange(0, EBLK)
    rmask = rm < M
    emask = re < E
    live = rmask[:, None] & emask[None, :]
    x_rows = x_ptr + rm.to(tl.int64) * stride_xm
    total = tl.zeros((BM, EBLK), dtype=tl.float32)
    finish = True
    if SPLIT_GRID:
        s = tl.program_id(1)
        part = _chain_chunk(x_rows, rmask, gt_ptr, re, emask, E, K, s * KS, BM, EBLK, KS)
        ws = ws_ptr + rm[:, None].to(tl.int64) * EB + re[None, :]
        tl.store(ws + s.to(tl.int64) * ws_rows * EB, part, mask=live)
        finish = SUM
        if SUM:
            tile = pid_m * tl.num_programs(2) + pid_e
            finish = triton_splitk.arrive(cnt_ptr, tile, SPLITS, INTERP)
            if finish:
                total = triton_splitk.chunk_sum(total, ws, ws_rows * EB, live, SPLITS)
                triton_splitk.depart(cnt_ptr, tile)
    else:
        for s in range(SPLITS):  # the chunks in order
            total += _chain_chunk(x_rows, rmask, gt_ptr, re, emask, E, K, s * KS, BM, EBLK, KS)
    if finish:
        tl.store(out_ptr + rm[:, None].to(tl.int64) * EB + re[None, :], total, mask=live)


def columns_major(gate: torch.Tensor) -> torch.Tensor:
    """gate [E, H] as a view of its transpose stored contiguous ([H, E]): the layout an fp32
    router reads through _router_chain_kernel (glm5_next's weights do not yet store it so; the
    bench does). The same values; returned as is when so already."""
    return gate if is_columns_major(gate) else gate.t().contiguous().t()


def is_columns_major(gate: torch.Tensor) -> bool:
    """gate [E, H] is the view of a contiguous [H, E]."""
    return gate.dim() == 2 and gate.stride(0) == 1 and gate.stride(1) == gate.shape[0]


def _chain_logits(x: torch.Tensor, gate: torch.Tensor, eb: int) -> tuple[torch.Tensor, int]:
    """An fp32 router's logits on _router_chain_kernel (gate columns-major): (part, splits),
    part [splits, N, EB] fp32 for the route kernel to add up in order: [1, N, EB] when the
    chain's own launch added its chunks (switches.FP32_CHAIN_SUMS, or a pass of more rows than
    FP32_CHAIN_SPLIT_ROWS, whose programs walk the chunks), the chunks' partials otherwise.
    Either way a logit is +0 + chunk 0 + chunk 1 + ...: the same bits."""
    n, h = x.shape
    e = gate.shape[0]
    splits = cdiv(h, FP32_CHAIN_SPLIT)
    split_grid = n <= FP32_CHAIN_SPLIT_ROWS
    rows = 1 if n == 1 else FP32_CHAIN_ROWS
    eblk = min(next_power_of_2(e), FP32_CHAIN_EXPERTS)
    grid = (cdiv(n, rows), splits if split_grid else 1, cdiv(e, eblk))
    summed = switches.FP32_CHAIN_SUMS.on() or not split_grid
    out = torch.empty(1 if summed else splits, n, eb, dtype=torch.float32, device=x.device)
    if n == 0:
        return out, out.shape[0]
    ws_rows = grid[0] * rows
    if split_grid and summed:
        ws = torch.empty(splits, ws_rows, eb, dtype=torch.float32, device=x.device)
        cnt = triton_splitk.counters(x.device, grid[0] * grid[2])
    elif split_grid:  # the partials are the output; its rows are the pass's
        ws, cnt, ws_rows = out, out, n
    else:
        ws = cnt = out
    _router_chain_kernel[grid](
        x,
        gate.t(),
        out,
        ws,
        cnt,
        n,
        e,
        h,
        x.stride(0),
        ws_rows,
        EB=eb,
        BM=rows,
        EBLK=eblk,
        KS=FP32_CHAIN_SPLIT,
        SPLITS=splits,
        SPLIT_GRID=split_grid,
        SUM=summed,
        INTERP=interpreting(),
        num_warps=max(1, min(4, rows * eblk // 32)),
        **launch_options(x),
    )
    return out, out.shape[0]


@triton.jit
def _keep_groups(
    key,
    ex,
    ROWS: tl.constexpr,
    EB: tl.constexpr,
    EPG: tl.constexpr,
    GROUPS: tl.constexpr,
    KEEP: tl.constexpr,
    GB: tl.constexpr,
):
    """key [ROWS, EB] (-inf past E) -> key with every expert outside the KEEP best of GROUPS
    groups of EPG experts at -inf. A group scores the sum of its two best keys; ties go to
    the lower group."""
    gcol = tl.arange(0, GB)
    grp = ex // EPG
    gscore = tl.full((ROWS, GB), float("-inf"), tl.float32)
    for g in tl.static_range(GROUPS):
        kg = tl.where((grp == g)[None, :], key, float("-inf"))
        b1 = tl.max(kg, axis=1)
        a1 = tl.argmax(kg, axis=1, tie_break_left=True)
        b2 = tl.max(tl.where(ex[None, :] == a1[:, None], float("-inf"), kg), axis=1)
        gscore = tl.where(gcol[None, :] == g, (b1 + b2)[:, None], gscore)
    keep = tl.zeros((ROWS, EB), dtype=tl.int1)
    for _ in tl.static_range(KEEP):
        best = tl.argmax(gscore, axis=1, tie_break_left=True)
        gscore = tl.where(gcol[None, :] == best[:, None], float("-inf"), gscore)
        keep = keep | (grp[None, :] == best[:, None])
    return tl.where(keep, key, float("-inf"))


@triton.jit(do_not_specialize=["n_rows", "max_blocks"])  # one binary for any row count
def _route_kernel(
    part_ptr,
    bias_ptr,
    scale_ptr,
    lt_ptr,
    w_ptr,
    e_ptr,
    n_rows,
    E,
    S: tl.constexpr,
    scaling,
    norm_eps,
    TOPK: tl.constexpr,
    KB: tl.constexpr,
    EB: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM: tl.constexpr,
    GROUPS: tl.constexpr,
    EPG: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    GB: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    sorted_ptr=None,
    block_ptr=None,
    max_blocks=0,
    ALIGN: tl.constexpr = False,
    BM: tl.constexpr = 16,
    PB: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    PAIRWISE: tl.constexpr = False,
):
    """lt_ptr: only its dtype is read, the logits' (and sigmoid scores') dtype; the weights are
    rounded to w_ptr's. ALIGN (a pass that this one program holds, of at most PB pairs): its
    pairs sorted by expert too, as triton_align.align(experts, E, BM) sorts them, to sorted_ptr
    and block_ptr."""
    after_prior(PDL)
    _route_rows(
        tl.program_id(0) * ROWS,
        part_ptr,
        bias_ptr,
        scale_ptr,
        lt_ptr,
        w_ptr,
        e_ptr,
        n_rows,
        E,
        S,
        scaling,
        norm_eps,
        TOPK,
        KB,
        EB,
        SOFTMAX,
        HAS_BIAS,
        HAS_SCALE,
        NORM,
        GROUPS,
        EPG,
        KEEP_GROUPS,
        GB,
        BY_EXPERT,
        ROWS,
        sorted_ptr,
        block_ptr,
        max_blocks,
        ALIGN,
        BM,
        PB,
        False,
        PAIRWISE,
    )


@triton.jit
def _route_rows(
    row0,
    part_ptr,
    bias_ptr,
    scale_ptr,
    lt_ptr,
    w_ptr,
    e_ptr,
    n_rows,
    E,
    S: tl.constexpr,
    scaling,
    norm_eps,
    TOPK: tl.constexpr,
    KB: tl.constexpr,
    EB: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM: tl.constexpr,
    GROUPS: tl.constexpr,
    EPG: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    GB: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    sorted_ptr,
    block_ptr,
    max_blocks,
    ALIGN: tl.constexpr,
    BM: tl.constexpr,
    PB: tl.constexpr,
    VOLATILE: tl.constexpr,
    PAIRWISE: tl.constexpr,
):
    """Rows row0 .. row0 + ROWS: their partials summed in split order, scored, their top k
    picked and weighted (VOLATILE: the partials read past L1, written by other programs of this
    launch). The splits' loop is unrolled, so their loads are in flight together.
    PAIRWISE: the pairs aligned by _align_pairwise."""
    rows = row0 + tl.arange(0, ROWS)
    ex = tl.arange(0, EB)
    rmask = rows < n_rows
    emask = ex < E
    ldt = lt_ptr.dtype.element_ty
    dt = w_ptr.dtype.element_ty
    acc = tl.zeros((ROWS, EB), dtype=tl.float32)
    for s in tl.static_range(S):  # the K splits, always in this order
        offs = (s * n_rows + rows)[:, None].to(tl.int64) * EB + ex[None, :]
        acc += tl.load(
            part_ptr + offs, mask=rmask[:, None] & emask[None, :], other=0.0, volatile=VOLATILE
        )
    lg = acc.to(ldt).to(tl.float32)  # the router's logits, rounded as the reference's
    if SOFTMAX:
        lg = tl.where(emask[None, :], lg, float("-inf"))
        p = tl.exp(lg - tl.max(lg, axis=1)[:, None])
        score = p / tl.sum(p, axis=1)[:, None]
    else:
        score = (1.0 / (1.0 + tl.exp(-lg))).to(ldt).to(tl.float32)
    key = score
    if HAS_BIAS:
        key = key + tl.load(bias_ptr + ex, mask=emask, other=0.0)[None, :]
    key = tl.where(emask[None, :], key, float("-inf"))
    if GROUPS > 1:
        key = _keep_groups(key, ex, ROWS, EB, EPG, GROUPS, KEEP_GROUPS, GB)
    if HAS_SCALE:
        es = tl.load(scale_ptr + ex, mask=emask, other=0.0).to(tl.float32)
    else:
        es = tl.zeros((EB,), dtype=tl.float32)
    kcol = tl.arange(0, KB)
    picked = tl.zeros((ROWS, KB), dtype=tl.int64)
    wts = tl.zeros((ROWS, KB), dtype=tl.float32)
    scl = tl.zeros((ROWS, KB), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pick = tl.argmax(key, axis=1, tie_break_left=True)  # [ROWS]
        hit = ex[None, :] == pick[:, None]
        wj = tl.sum(tl.where(hit, score, 0.0), axis=1)
        key = tl.where(hit, float("-inf"), key)
        total = total + wj
        picked = tl.where(kcol[None, :] == j, pick[:, None].to(tl.int64), picked)
        wts = tl.where(kcol[None, :] == j, wj[:, None], wts)
        if HAS_SCALE:
            sj = tl.sum(tl.where(hit, es[None, :], 0.0), axis=1)
            scl = tl.where(kcol[None, :] == j, sj[:, None], scl)
    if NORM:
        denom = (total.to(dt).to(tl.float32) + norm_eps).to(dt).to(tl.float32)
        wts = (wts / denom[:, None]).to(dt).to(tl.float32)
    if HAS_SCALE:
        wts = wts * scl
    out = (wts * scaling).to(dt)
    valid = kcol < TOPK
    if BY_EXPERT:  # each row's slots in ascending expert order (experts are distinct)
        before = (picked[:, None, :] < picked[:, :, None]) & valid[None, None, :]  # [R, j, i]
        rank = tl.sum(before.to(tl.int32), axis=2)  # slot j's place
        at = (rank[:, None, :] == kcol[None, :, None]) & valid[None, None, :]  # [R, place, j]
        picked = tl.sum(tl.where(at, picked[:, None, :], 0), axis=2)
        out = tl.sum(tl.where(at, out.to(tl.float32)[:, None, :], 0.0), axis=2).to(dt)
    offs = rows[:, None] * TOPK + kcol[None, :]
    m = rmask[:, None] & valid[None, :]
    tl.store(e_ptr + offs, picked, mask=m)
    tl.store(w_ptr + offs, out, mask=m)
    if ALIGN:  # the pass's pairs back from memory (a [ROWS, KB] tile has no row to slice)
        tl.debug_barrier()  # every thread's stores above seen by the whole program
        pairs = n_rows * TOPK
        p = tl.arange(0, PB)
        ids = tl.load(e_ptr + p, mask=p < pairs, other=EB).to(tl.int32)
        align_pairs(ids, p, sorted_ptr, block_ptr, pairs, E, max_blocks, BM, EB, 64, PAIRWISE)


@triton.jit
def _router_route_kernel(
    x_ptr,
    g_ptr,
    part_ptr,
    cnt_ptr,
    bias_ptr,
    scale_ptr,
    lt_ptr,
    w_ptr,
    e_ptr,
    K,
    stride_xm,
    E,
    S: tl.constexpr,
    scaling,
    norm_eps,
    sorted_ptr,
    block_ptr,
    max_blocks,
    F32: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    PBM: tl.constexpr,
    EBLK: tl.constexpr,
    KS: tl.constexpr,
    BK: tl.constexpr,
    TOPK: tl.constexpr,
    KB: tl.constexpr,
    EB: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    NORM: tl.constexpr,
    GROUPS: tl.constexpr,
    EPG: tl.constexpr,
    KEEP_GROUPS: tl.constexpr,
    GB: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    BM: tl.constexpr,
    y_ptr=None,
    r_ptr=None,
    nw_ptr=None,
    h_ptr=None,
    in_eps=0.0,
    NORM_IN: tl.constexpr = False,
    NROWS: tl.constexpr = 1,
    BLOCK_D: tl.constexpr = 16,
    PDL: tl.constexpr = False,
    PAIRWISE: tl.constexpr = False,
):
    """A pass of one row in one launch: each program writes its split of the logits as
    _router_partial_kernel does, and the last to arrive routes and aligns the row as
    _route_kernel does (the same sums in the same order, so the same bits). NORM_IN: first
    h = y + r and x = rms_norm(h) (weight nw), written to h_ptr and x_ptr by every program (the
    same values) as triton_norms' kernel computes them: norm_rows on the same tile, in as many
    warps (NORM_WARPS), so the same bits."""
    after_prior(PDL)
    if NORM_IN:
        norm_rows(
            y_ptr, r_ptr, nw_ptr, x_ptr, h_ptr, 0, 1, K, in_eps, True, NROWS, BLOCK_D, 1, False
        )
        tl.debug_barrier()  # the program's stores of x seen by all its threads before it reads x
    _router_partial(
        x_ptr, g_ptr, part_ptr, 1, E, K, stride_xm, F32, IEEE, INTERP, PBM, EB, EBLK, KS, BK
    )
    publish_writes(INTERP)
    programs = tl.num_programs(1) * tl.num_programs(2)
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
        _route_rows(
            0,
            part_ptr,
            bias_ptr,
            scale_ptr,
            lt_ptr,
            w_ptr,
            e_ptr,
            1,
            E,
            S,
            scaling,
            norm_eps,
            TOPK,
            KB,
            EB,
            SOFTMAX,
            HAS_BIAS,
            HAS_SCALE,
            NORM,
            GROUPS,
            EPG,
            KEEP_GROUPS,
            GB,
            BY_EXPERT,
            ROWS,
            sorted_ptr,
            block_ptr,
            max_blocks,
            True,
            BM,
            KB,
            True,
            PAIRWISE,
        )
        tl.atomic_xchg(cnt_ptr, 0)


def _partial_tiles(x: torch.Tensor, gate: torch.Tensor, fp32: bool) -> dict:
    """The router GEMV's split of H and its tiles, from H, E and fp32 alone."""
    e = gate.shape[0]
    eb = max(16, next_power_of_2(e))
    # An fp32 product is a plain FMA loop, not a tensor-core one: smaller tiles keep its
    # operands in registers. Neither tile changes a row's reduction order.
    bm, bk = (16, 32) if fp32 else (64, min(128, ROUTER_SPLIT))
    eblk = min(eb, FP32_EXPERT_BLOCK if fp32 else EXPERT_BLOCK)
    return dict(
        eb=eb,
        eblk=eblk,
        splits=cdiv(x.shape[1], ROUTER_SPLIT),
        bm=bm,
        bk=bk,
        ieee=fp32 or x.dtype == torch.float32,
    )


def _partials(x: torch.Tensor, gate: torch.Tensor, fp32: bool, t: dict) -> torch.Tensor:
    """The router's logits in fixed splits of H (_partial_tiles' t): [splits, N, EB] fp32."""
    n, h = x.shape
    e = gate.shape[0]
    part = torch.empty(t["splits"], n, t["eb"], dtype=torch.float32, device=x.device)
    if n:
        _router_partial_kernel[(cdiv(n, t["bm"]), t["splits"], cdiv(e, t["eblk"]))](
            x,
            gate,
            part,
            n,
            e,
            h,
            x.stride(0),
            F32=fp32,
            IEEE=t["ieee"],
            INTERP=interpreting(),
            BM=t["bm"],
            EB=t["eb"],
            EBLK=t["eblk"],
            KS=ROUTER_SPLIT,
            BK=t["bk"],
            num_warps=4,
            **launch_options(x),
        )
    return part


def _route(
    x: torch.Tensor,
    gate: torch.Tensor,
    fp32: bool,
    top_k: int,
    logit_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    *,
    softmax: bool,
    bias: torch.Tensor | None,
    scale: torch.Tensor | None,
    norm: bool,
    norm_eps: float,
    scaling: float,
    groups: int,
    keep_groups: int,
    by_expert: bool,
    norm_in: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's logits (x [N, H] @ gate [E, H]ᵀ in fixed splits of H), then each row's top k:
    (weights [N, k] in weight_dtype, experts [N, k] long). A pass of one row or a few (a decode
    round of a few streams; aligns_in_route) has its pairs sorted by expert for the expert GEMMs
    too (what triton_align.align does); one row, for up to FUSE_MAX_EXPERTS experts, runs the
    logits and the top k in one launch.
    norm_in (with that launch only): the launch's extra arguments that make x there first
    (norm_route)."""
    n, h = x.shape
    e = gate.shape[0]
    x = x.contiguous() if x.stride(-1) != 1 else x
    chain = fp32 and is_columns_major(gate)
    if not chain:
        gate = gate.contiguous()
    t = _partial_tiles(x, gate, fp32)
    eb = t["eb"]
    weights = torch.empty(n, top_k, dtype=weight_dtype, device=x.device)
    experts = torch.empty(n, top_k, dtype=torch.long, device=x.device)
    if n == 0:
        return weights, experts
    assert e % groups == 0 and 1 <= keep_groups <= groups
    select = dict(
        TOPK=top_k,
        KB=next_power_of_2(top_k),
        EB=eb,
        SOFTMAX=softmax,
        HAS_BIAS=bias is not None,
        HAS_SCALE=scale is not None,
        NORM=norm,
        GROUPS=groups,
        EPG=e // groups,
        KEEP_GROUPS=keep_groups,
        GB=max(2, next_power_of_2(groups)),
        BY_EXPERT=by_expert,
        ROWS=route_rows(e),
        num_warps=4,
    )
    lt = torch.empty(0, dtype=logit_dtype, device=x.device)
    aligned = None
    if aligns_in_route(n, top_k, e, select["ROWS"]):
        blocks = max_blocks_for(n * top_k, e, TINY_BLOCK_M)
        aligned = Aligned(
            torch.empty(blocks * TINY_BLOCK_M, dtype=torch.int32, device=x.device),
            torch.empty(blocks, dtype=torch.int32, device=x.device),
            blocks,
            experts.reshape(-1),
            TINY_BLOCK_M,
            e,
        )
    if not chain and fuses_one_row(n, e, sigmoid=not softmax and groups == 1):
        if not softmax and groups == 1:  # no sum whose order a layout sets
            select["ROWS"] = 1
        select["PAIRWISE"] = t["eb"] > next_power_of_2(top_k)
        part = torch.empty(t["splits"], 1, eb, dtype=torch.float32, device=x.device)
        assert aligned is not None  # one row (fuses_one_row) aligns in the route
        _router_route_kernel[(1, t["splits"], cdiv(e, t["eblk"]))](
            x,
            gate,
            part,
            triton_splitk.counters(x.device, 1),
            bias if bias is not None else part,
            scale if scale is not None else part,
            lt,
            weights,
            experts,
            h,
            x.stride(0),
            e,
            t["splits"],
            float(scaling),
            float(norm_eps),
            aligned.sorted_pairs,
            aligned.block_expert,
            blocks,
            F32=fp32,
            IEEE=t["ieee"],
            INTERP=interpreting(),
            PBM=t["bm"],
            EBLK=t["eblk"],
            KS=ROUTER_SPLIT,
            BK=t["bk"],
            BM=TINY_BLOCK_M,
            **select,
            **(norm_in or {}),
            **launch_options(x),
        )
    else:
        assert norm_in is None
        if groups == 1 and (n == 1 or aligned is None):
            select.update(ROWS=1, num_warps=1)  # a row's layout kept (the [1, E] tile, above)
            if n == 1 and not softmax:
                select["num_warps"] = SIGMOID_ONE_ROW_WARPS
        if chain:
            part, t["splits"] = _chain_logits(x, gate, eb)
        else:
            part = _partials(x, gate, fp32, t)
        pb = next_power_of_2(n * top_k)
        align = (
            {}
            if aligned is None
            else dict(
                sorted_ptr=aligned.sorted_pairs,
                block_ptr=aligned.block_expert,
                max_blocks=aligned.max_blocks,
                ALIGN=True,
                BM=TINY_BLOCK_M,
                PB=pb,
                PAIRWISE=eb > pb,
            )
        )
        _route_kernel[(cdiv(n, select["ROWS"]),)](
            part,
            bias if bias is not None else part,
            scale if scale is not None else part,
            lt,
            weights,
            experts,
            n,
            e,
            t["splits"],
            float(scaling),
            float(norm_eps),
            **align,
            **select,
            **launch_options(part),
        )
    if aligned is not None:
        experts.tf_aligned = aligned  # type: ignore[attr-defined]  # rides on the tensor
    return weights, experts


def route_rows(experts: int) -> int:
    """Rows a route program takes (_route_kernel's ROWS): from the number of experts alone."""
    return max(1, min(ROUTE_ROWS, 4096 // max(16, next_power_of_2(experts))))


def aligns_in_route(n: int, top_k: int, experts: int, rows: int) -> bool:
    """Whether a pass of n rows has its pairs aligned by its router (one route program holding
    the pass, ROWS rows a program), not by triton_align's launch."""
    return n == 1 or (
        n <= min(rows, TINY_ROWS)
        and next_power_of_2(n * top_k) * next_power_of_2(experts) <= FEW_ROWS_ONE_HOT
    )


def fuses_one_row(n: int, experts: int, sigmoid: bool = False) -> bool:
    """Whether a pass of n rows routes in one launch (_router_route_kernel); sigmoid: a
    sigmoid route without expert groups (FUSE_MAX_SIGMOID_EXPERTS)."""
    most = max(FUSE_MAX_EXPERTS, FUSE_MAX_SIGMOID_EXPERTS) if sigmoid else FUSE_MAX_EXPERTS
    return n == 1 and experts <= most


def norm_route(
    y: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor,
    expert_bias: torch.Tensor | None,
    top_k: int,
    *,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = y + residual, x = rms_norm(h) (triton_norms.add_rms_norm), then route(x, ...):
    (x, h, weights, experts). A pass of one row does all of it in the router's one launch (the
    norm's bits as its own kernel's); other passes launch the norm and route as they are."""
    n, d = y.shape
    if not (
        fuses_one_row(n, gate.shape[0], sigmoid=True)
        and residual.dtype == y.dtype
        and norm_weight.dtype == y.dtype
        and y.stride(-1) == 1
    ):
        from .triton_norms import add_rms_norm

        x, h = add_rms_norm(y, residual, norm_weight, eps)
        return (
            x,
            h,
            *route(x, gate, expert_bias, top_k, norm_topk_prob=norm_topk_prob, scaling=scaling),
        )
    y, residual = y.contiguous(), residual.contiguous()
    x, h = torch.empty_like(y), torch.empty_like(y)
    rows, block_d = rows_per_program(d)
    assert NORM_WARPS == 4  # the router launch's warps (_route's select)
    norm_in = dict(
        y_ptr=y,
        r_ptr=residual,
        nw_ptr=norm_weight.contiguous(),
        h_ptr=h,
        in_eps=float(eps),
        NORM_IN=True,
        NROWS=rows,
        BLOCK_D=block_d,
    )
    weights, experts = _route(
        x,
        gate,
        False,
        top_k,
        x.dtype,
        x.dtype,
        softmax=False,
        bias=expert_bias,
        scale=None,
        norm=norm_topk_prob,
        norm_eps=1e-6,
        scaling=scaling,
        groups=1,
        keep_groups=1,
        by_expert=False,
        norm_in=norm_in,
    )
    return x, h, weights, experts


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    expert_bias: torch.Tensor | None,
    top_k: int,
    *,
    norm_topk_prob: bool,
    scaling: float,
    fp32: bool = False,
    norm_eps: float = 1e-6,
    groups: int = 1,
    keep_groups: int = 1,
    by_expert: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing. x [N, H]; gate [E, H]; expert_bias [E] fp32 -> (weights [N, k],
    experts [N, k] long), slots in descending order of score + bias (by_expert: ascending
    expert). Logits, scores and weights in x's dtype (ops/moe.py's `route`), or, with fp32, in
    fp32 from x.float() @ gate.float()ᵀ (glm5_next). Weights: the chosen scores, divided by
    (their sum + norm_eps) when norm_topk_prob, times scaling. groups > 1: experts are chosen
    within the keep_groups best of `groups` equal groups, a group scoring its two best keys."""
    dt = torch.float32 if fp32 else x.dtype
    return _route(
        x,
        gate,
        fp32,
        top_k,
        dt,
        dt,
        softmax=False,
        bias=expert_bias,
        scale=None,
        norm=norm_topk_prob,
        norm_eps=norm_eps,
        scaling=scaling,
        groups=groups,
        keep_groups=keep_groups,
        by_expert=by_expert,
    )


def softmax_route(
    x: torch.Tensor,
    gate: torch.Tensor,
    top_k: int,
    expert_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing (gemma4). x [N, H]; gate [E, H]; expert_scale [E] -> (weights [N, k]
    fp32, experts [N, k] long): logits x gateᵀ rounded to x's dtype, softmax in fp32, the top k
    (descending; ties to the lower expert), divided by their sum, times expert_scale."""
    return _route(
        x,
        gate,
        False,
        top_k,
        x.dtype,
        torch.float32,
        softmax=True,
        bias=None,
        scale=expert_scale,
        norm=True,
        norm_eps=0.0,
        scaling=1.0,
        groups=1,
        keep_groups=1,
        by_expert=False,
    )


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _router_input_kernel(
    r_ptr,
    s_ptr,
    w_ptr,
    z_ptr,
    xe_ptr,
    n_rows,
    D,
    eps,
    const,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    dt = z_ptr.dtype.element_ty
    x = tl.load(r_ptr + row * D + cols, mask=m, other=0.0).to(tl.float32)
    normed = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    s = tl.load(s_ptr + cols, mask=m, other=0.0).to(tl.float32)
    z = (normed.to(dt).to(tl.float32) * s).to(dt).to(tl.float32)
    tl.store(z_ptr + row * D + cols, (z * const).to(dt), mask=m)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(xe_ptr + row * D + cols, (normed * w).to(dt), mask=m)


def router_input(
    r: torch.Tensor,
    eps: float,
    scale: torch.Tensor,
    const: float,
    pre_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gemma4's router and experts' inputs from the residual r [N, H], with x̂ = r·(mean(r²) +
    eps)^-½ in fp32: z = ((x̂ → r's dtype) · scale → dtype) · const → dtype, and
    xe = x̂ · pre_norm (fp32) → dtype. scale [H] in r's dtype; pre_norm [H] fp32."""
    r = r.contiguous()
    n, d = r.shape
    z, xe = torch.empty_like(r), torch.empty_like(r)
    if n:
        _router_input_kernel[(n,)](
            r,
            scale.contiguous(),
            pre_norm.contiguous(),
            z,
            xe,
            n,
            d,
            float(eps),
            float(const),
            BLOCK_D=next_power_of_2(d),
            num_warps=8 if d > 2048 else 4,
            **launch_options(r),
        )
    return z, xe
