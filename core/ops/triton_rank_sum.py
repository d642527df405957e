"""The ranks' partials summed in one kernel: out[i] = Σ_r float32(part_r[i]), r = 0, 1, ...
in rank order, rounded once to out's dtype, as `tensorfold.ops.parallel.rank_order_sum`
computes it in torch (its reference).

Each element reads only its own W values and adds them one after the other, so its bits do not
depend on the message's size, the block size or which program holds it. The parts may be other
GPUs' memory mapped here (symmetric memory's peer buffers), read over NVLink.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .triton_util import cdiv

MAX_WORLD = 8
BLOCK = 1024


@triton.jit(do_not_specialize=["n"])  # one binary for any message size
def _rank_sum_kernel(
    p0,
    p1,
    p2,
    p3,
    p4,
    p5,
    p6,
    p7,
    out_ptr,
    n,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(p0 + offs, mask=mask).to(tl.float32)
    # plain fp32 adds in rank order (no FMA can form: nothing is multiplied)
    if WORLD > 1:
        acc = acc + tl.load(p1 + offs, mask=mask).to(tl.float32)
    if WORLD > 2:
        acc = acc + tl.load(p2 + offs, mask=mask).to(tl.float32)
    if WORLD > 3:
        acc = acc + tl.load(p3 + offs, mask=mask).to(tl.float32)
    if WORLD > 4:
        acc = acc + tl.load(p4 + offs, mask=mask).to(tl.float32)
    if WORLD > 5:
        acc = acc + tl.load(p5 + offs, mask=mask).to(tl.float32)
    if WORLD > 6:
        acc = acc + tl.load(p6 + offs, mask=mask).to(tl.float32)
    if WORLD > 7:
        acc = acc + tl.load(p7 + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def rank_sum(parts: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """parts: W flat tensors of one dtype, each at least out.numel() long (rank r's partial in
    parts[r]); out: contiguous, written and returned."""
    world = len(parts)
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"rank_sum takes 1 to {MAX_WORLD} parts, got {world}")
    n = out.numel()
    if n == 0:
        return out
    ptrs = list(parts) + [parts[0]] * (MAX_WORLD - world)  # the unused ones are never read
    grid = (cdiv(n, BLOCK),)
    _rank_sum_kernel[grid](*ptrs, out, n, WORLD=world, BLOCK=BLOCK, num_warps=4)
    return out
