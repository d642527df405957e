"""Sorting a pass's (row, slot) pairs by expert on the GPU in Triton, for the grouped GEMMs.

Pairs r*k + j are ordered by expert (stable), each expert's run padded to a multiple of the
GEMMs' block of rows, and every block is mapped to its expert (or to E past the last one), all
on the device: no host sync, so a decode round's align is captured in its CUDA graph. One
program does a decode round's few pairs; a prompt's many take a program per chunk of pairs
(histograms first, then each chunk's scatter). The order is a pure function of the experts,
so how it is computed never changes a result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, cdiv, next_power_of_2

ALIGN_CHUNK = 256  # pairs one program aligns alone; a chunk's pairs (fewer for many experts)


@triton.jit
def _layout(counts, BM: tl.constexpr):
    """Each expert's run padded to BM rows: (padded, ends, starts, total) in sorted order."""
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    return padded, ends, ends - padded, tl.sum(padded, axis=0)


@triton.jit
def _pad_and_map(
    sorted_ptr,
    block_ptr,
    counts,
    padded,
    ends,
    starts,
    total,
    P,
    E,
    max_blocks,
    BM: tl.constexpr,
    BB: tl.constexpr,
):
    """Each run's padding (pair P) and every block's expert (E past the last run)."""
    j = tl.arange(0, BM)
    pad_at = (starts + counts)[:, None] + j[None, :]
    tl.store(sorted_ptr + pad_at, P, mask=j[None, :] < (padded - counts)[:, None])
    for b0 in range(0, max_blocks, BB):
        b = b0 + tl.arange(0, BB)
        row = b * BM
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(row < total, owner, E)
        tl.store(block_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def _align_pairwise(
    ids,
    p,
    sorted_ptr,
    block_ptr,
    P,
    E,
    max_blocks,
    BM: tl.constexpr,
    EB: tl.constexpr,
    BB: tl.constexpr,
):
    """align_pairs by comparing the pairs with each other ([PB, PB] tiles), not with every
    expert: each expert's run found from its first pair. The same writes as the one-hot."""
    ok = ids < EB
    same = (ids[:, None] == ids[None, :]) & ok[:, None] & ok[None, :]  # [PB i, PB j]
    earlier = p[None, :] < p[:, None]
    count = tl.sum(same.to(tl.int32), axis=1)
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)  # earlier pairs of i's expert
    first = ok & (rank == 0)  # the pair that stands for its expert's run
    padded = tl.where(first, (count + BM - 1) // BM * BM, 0)
    below = first[None, :] & (ids[None, :] < ids[:, None])  # [i, j]: j's run before i's
    start = tl.sum(tl.where(below, padded[None, :], 0), axis=1)
    total = tl.sum(padded, axis=0)
    tl.store(sorted_ptr + start + rank, p, mask=ok)
    j = tl.arange(0, BM)
    pad_at = (start + count)[:, None] + j[None, :]
    tl.store(sorted_ptr + pad_at, P, mask=first[:, None] & (j[None, :] < (padded - count)[:, None]))
    for b0 in range(0, max_blocks, BB):
        b = b0 + tl.arange(0, BB)
        row = b * BM
        inside = (
            first[None, :]
            & (start[None, :] <= row[:, None])
            & (row[:, None] < (start + padded)[None, :])
        )  # [BB, PB]
        owner = tl.sum(tl.where(inside, ids[None, :], 0), axis=1)
        owner = tl.where(row < total, owner, E)
        tl.store(block_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def align_pairs(
    ids,
    p,
    sorted_ptr,
    block_ptr,
    P,
    E,
    max_blocks,
    BM: tl.constexpr,
    EB: tl.constexpr,
    BB: tl.constexpr,
    PAIRWISE: tl.constexpr = False,
):
    """All of a pass's pairs at once, from a program that holds them (the router's, in a
    decode round): ids [PB] their experts (EB where no pair), p [PB] their indices, ascending
    where ids < EB. Writes what _align_kernel writes (PAIRWISE: _align_pairwise's way)."""
    if PAIRWISE:
        _align_pairwise(ids, p, sorted_ptr, block_ptr, P, E, max_blocks, BM, EB, BB)
    else:
        ex = tl.arange(0, EB)
        hot = (ids[:, None] == ex[None, :]).to(tl.int32)  # [PB, EB]
        counts = tl.sum(hot, axis=0)
        padded, ends, starts, total = _layout(counts, BM)
        rank = tl.cumsum(hot, axis=0) - hot
        dest = tl.sum(hot * starts[None, :] + hot * rank, axis=1)
        tl.store(sorted_ptr + dest, p, mask=ids < EB)
        _pad_and_map(
            sorted_ptr, block_ptr, counts, padded, ends, starts, total, P, E, max_blocks, BM, BB
        )


@triton.jit(do_not_specialize=["P", "max_blocks"])  # one binary for any row count
def _align_kernel(
    expert_ptr,
    sorted_ptr,
    block_ptr,
    P,
    E,
    max_blocks,
    BM: tl.constexpr,
    EB: tl.constexpr,
    CHUNK: tl.constexpr,
    BB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ids = tl.load(expert_ptr + p, mask=p < P, other=EB).to(tl.int32)
        counts += tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0)
    padded, ends, starts, total = _layout(counts, BM)
    run = tl.zeros((EB,), dtype=tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ids = tl.load(expert_ptr + p, mask=p < P, other=EB).to(tl.int32)
        hot = (ids[:, None] == ex[None, :]).to(tl.int32)  # [CHUNK, EB]
        rank = tl.cumsum(hot, axis=0) - hot
        dest = tl.sum(hot * (starts + run)[None, :] + hot * rank, axis=1)
        tl.store(sorted_ptr + dest, p, mask=p < P)
        run += tl.sum(hot, axis=0)
    _pad_and_map(
        sorted_ptr, block_ptr, counts, padded, ends, starts, total, P, E, max_blocks, BM, BB
    )


@triton.jit
def _chunk_hist_kernel(
    expert_ptr, hist_ptr, P, EB: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False
):
    after_prior(PDL)
    c = tl.program_id(0)
    ex = tl.arange(0, EB)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(expert_ptr + p, mask=p < P, other=EB).to(tl.int32)
    tl.store(hist_ptr + c * EB + ex, tl.sum((ids[:, None] == ex[None, :]).to(tl.int32), axis=0))


@triton.jit
def _chunk_scatter_kernel(
    expert_ptr,
    hist_ptr,
    sorted_ptr,
    block_ptr,
    P,
    E,
    n_chunks,
    max_blocks,
    BM: tl.constexpr,
    EB: tl.constexpr,
    CHUNK: tl.constexpr,
    CB: tl.constexpr,
    BB: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Chunk c's pairs to their sorted places, from every chunk's histogram; chunk 0 also
    writes the padding and the block map."""
    after_prior(PDL)
    c = tl.program_id(0)
    ex = tl.arange(0, EB)
    counts = tl.zeros((EB,), dtype=tl.int32)
    before = tl.zeros((EB,), dtype=tl.int32)
    for c0 in range(0, n_chunks, CB):
        rows = c0 + tl.arange(0, CB)
        h = tl.load(
            hist_ptr + rows[:, None] * EB + ex[None, :], mask=rows[:, None] < n_chunks, other=0
        )
        counts += tl.sum(h, axis=0)
        before += tl.sum(tl.where(rows[:, None] < c, h, 0), axis=0)
    padded, ends, starts, total = _layout(counts, BM)
    p = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(expert_ptr + p, mask=p < P, other=EB).to(tl.int32)
    hot = (ids[:, None] == ex[None, :]).to(tl.int32)
    rank = tl.cumsum(hot, axis=0) - hot
    dest = tl.sum(hot * (starts + before)[None, :] + hot * rank, axis=1)
    tl.store(sorted_ptr + dest, p, mask=p < P)
    if c == 0:
        _pad_and_map(
            sorted_ptr, block_ptr, counts, padded, ends, starts, total, P, E, max_blocks, BM, BB
        )


@dataclass
class Aligned:
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32: pair index, or P for padding
    block_expert: torch.Tensor  # [max_blocks] int32: expert, or E past the last block
    max_blocks: int
    # the experts align read (pair r*k + j's at r*k + j; the dense FFN's: block_expert). The
    # GEMMs' weight prefetch reads them before its wait: a hint only (clamped to an expert),
    # so a stale value where the router aligned in the same kernel costs nothing but bytes
    pair_expert: torch.Tensor
    block_m: int = 0  # the run padding (0: not recorded)
    num_experts: int = 0


def max_blocks_for(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m the sorted pairs can take at most: every expert's run padded."""
    return cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def align(experts: torch.Tensor, num_experts: int, block_m: int) -> Aligned:
    """experts [N, k] -> the pairs r*k + j sorted by expert (stable), each run padded to
    block_m rows."""
    flat = experts.reshape(-1)
    p = flat.numel()
    max_blocks = max_blocks_for(p, num_experts, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=flat.device)
    eb = next_power_of_2(num_experts)
    chunk = max(16, min(ALIGN_CHUNK, 16384 // eb))  # a [chunk, EB] one-hot stays small
    if p <= ALIGN_CHUNK:  # one program (decode rounds)
        _align_kernel[(1,)](
            flat,
            sorted_pairs,
            block_expert,
            p,
            num_experts,
            max_blocks,
            BM=block_m,
            EB=eb,
            CHUNK=chunk,
            BB=64,
            num_warps=8,
            **launch_options(flat),
        )
    else:  # a program a chunk: histograms, then each chunk's scatter
        chunks = cdiv(p, chunk)
        hist = torch.empty(chunks, eb, dtype=torch.int32, device=flat.device)
        _chunk_hist_kernel[(chunks,)](
            flat, hist, p, EB=eb, CHUNK=chunk, num_warps=4, **launch_options(flat)
        )
        _chunk_scatter_kernel[(chunks,)](
            flat,
            hist,
            sorted_pairs,
            block_expert,
            p,
            num_experts,
            chunks,
            max_blocks,
            BM=block_m,
            EB=eb,
            CHUNK=chunk,
            CB=16,
            BB=64,
            num_warps=8,
            **launch_options(flat),
        )
    return Aligned(sorted_pairs, block_expert, max_blocks, flat, block_m, num_experts)
