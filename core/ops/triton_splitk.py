"""K split into a fixed number of chunks, for GEMMs whose rows are few.

A product over K in one program per output tile walks K serially; at one decode row a
[2048, 2048] weight gives 32 such programs on a 132-SM GPU, each bound by its own latency. Here
K is cut into SPLITS chunks of whole BLOCK_K steps, and each chunk's fp32 partial is summed in
chunk order: part_0 + part_1 + ... starting from +0. SPLITS comes from the weight's shape only,
so a row's bits never depend on the pass:
- a decode-sized pass runs one program per (tile, chunk); each writes its partial to a workspace,
  and the tile's last program to finish (an arrival counter per tile) adds them up in order;
- a prompt pass runs one program per tile, which computes the chunks one after the other and adds
  each to the running sum in the same order.
Both give the same bits (tests/test_triton_kernels.py checks it under the interpreter, and
tests/test_gpu_kernels.py on the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_util import cdiv, publish_writes

WAVE = 128  # programs a decode GEMM should offer: about one per SM of an H200 (bench/experiments/decode_kernels.py)
MAX_SPLITS = 8
COUNTERS = 1 << 16

_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def arrive(cnt_ptr, tile, SPLITS: tl.constexpr, INTERP: tl.constexpr):
    """After a program has stored its chunk's partials for output tile `tile`: publish them and
    count the program in. True for the tile's last program, which then adds the partials up
    (chunk_sum) and resets the counter (depart)."""
    publish_writes(INTERP)
    return tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLITS - 1


@triton.jit
def chunk_sum(total, ws, stride, mask, SPLITS: tl.constexpr):
    """total + partial 0 + partial 1 + ... (partial t at ws + t * stride, stored this launch by
    other programs: read past L1), in chunk order."""
    for t in tl.static_range(SPLITS):
        total += tl.load(ws + t * stride, mask=mask, other=0.0, volatile=True)
    return total


@triton.jit
def depart(cnt_ptr, tile):
    """The tile's counter back at zero for the next launch."""
    tl.atomic_xchg(cnt_ptr + tile, 0)


def splits_for(tiles: int, k_blocks: int, wave: int = 0) -> int:
    """Chunks for a product with `tiles` output tiles at one row and K of `k_blocks` BLOCK_K steps:
    a power of two, enough for about `wave` programs (0: WAVE), at most MAX_SPLITS and k_blocks."""
    want = cdiv(wave or WAVE, max(tiles, 1))
    splits = 1
    while splits < want and splits * 2 <= min(MAX_SPLITS, k_blocks):
        splits *= 2
    return splits


def chunk(k: int, block_k: int, splits: int) -> int:
    """Length of each chunk of K: whole BLOCK_K steps (the last chunk may be shorter)."""
    return cdiv(cdiv(k, block_k), splits) * block_k


def counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Arrival counters, zero between launches (each tile's last program resets its own); one
    buffer per device, made before any graph capture uses it."""
    if tiles > COUNTERS:
        raise ValueError(f"a split GEMM of {tiles} tiles exceeds the {COUNTERS} arrival counters")
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf
