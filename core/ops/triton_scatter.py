"""Rows copied into paged buffers on the GPU in Triton: up to MAX_PAIRS (buffer, rows) pairs at
the same flat rows in one launch, where torch's index_copy_ takes a launch a buffer (a layer's K
and V; glm5_next's latent and indexer rows). A copy: the buffers get the rows' bits."""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, next_power_of_2

SLOTS = 4  # the kernel's pair arguments
MAX_PAIRS = SLOTS  # pairs a launch takes
MAX_BLOCK = 1024


@triton.jit
def _copy_row(src, dst, width, BLOCK: tl.constexpr):
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        m = c < width
        tl.store(dst + c, tl.load(src + c, mask=m), mask=m)


@triton.jit
def _scatter_rows_kernel(
    index_ptr,
    s0,
    d0,
    ss0,
    w0,
    s1,
    d1,
    ss1,
    w1,
    s2,
    d2,
    ss2,
    w2,
    s3,
    d3,
    ss3,
    w3,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program (r, p): row r of pair p's rows to its buffer's flat row index[r]. Pair p: rows
    s [N, w] (row stride ss, inner contiguous), buffer d [R, w] contiguous."""
    after_prior(PDL)
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    at = tl.load(index_ptr + r).to(tl.int64)
    if p == 0:
        _copy_row(s0 + r * ss0, d0 + at * w0, w0, BLOCK)
    elif p == 1:
        _copy_row(s1 + r * ss1, d1 + at * w1, w1, BLOCK)
    elif p == 2:
        _copy_row(s2 + r * ss2, d2 + at * w2, w2, BLOCK)
    else:
        _copy_row(s3 + r * ss3, d3 + at * w3, w3, BLOCK)


def scatter_rows(index: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """For each (dst [R, *S], src [N, *S]) of pairs (at most MAX_PAIRS, src in dst's dtype):
    dst[index[i]] = src[i], in one launch. index [N] int."""
    assert 1 <= len(pairs) <= min(MAX_PAIRS, SLOTS)
    n = index.shape[0]
    args: list = []
    widest = 1
    for dst, src in pairs:
        assert dst.dtype == src.dtype and src.shape[0] == n and dst.shape[1:] == src.shape[1:]
        rows = src.reshape(n, -1)
        if rows.shape[1] and rows.stride(1) != 1:
            rows = rows.contiguous()
        flat = dst.view(dst.shape[0], -1)  # a paged buffer: contiguous
        width = flat.shape[1]
        args += [rows, flat, rows.stride(0), width]
        widest = max(widest, width)
    for _ in range(SLOTS - len(pairs)):  # slots no program takes
        args += args[:4]
    if n:
        _scatter_rows_kernel[(n, len(pairs))](
            index,
            *args,
            BLOCK=min(MAX_BLOCK, next_power_of_2(widest)),
            num_warps=4,
            **launch_options(index),
        )
