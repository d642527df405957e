"""Which path an fp8 weight's product takes on the GPU: the fp8 kernels of `triton_fp8` where
they read the weight's scales as stored, else the weight dequantized first (`linear_fp8`).
Torch only (the CPU path never imports Triton); `tensorfold.ops.fp8` re-exports it."""

from __future__ import annotations

from typing import Any

import torch

from ..family.fp8_weights import Fp8Weight

# A kernel's K step (64 or 128 long) must lie in one column block: bk a multiple of this, or all
# of K (one block across: per channel, per tensor, or a tiny weight inside one 128 block).
KERNEL_BK = 128


def kernel_reads(w: Fp8Weight) -> bool:
    """Whether the fp8 kernels read w's scales as stored: its column block bk a multiple of
    KERNEL_BK or all of K. The releases' 128 x 128 blocks, per channel and per tensor all are;
    the loader makes another bk only by cutting columns off the blocks (a tensor-parallel cut
    of K off a 128 edge, scales refined to (bn, 1)) or from a checkpoint of narrower blocks."""
    bk, k = w.block[1], w.shape[-1]
    return bk >= k or bk % KERNEL_BK == 0


def _one(w: Any) -> Any:
    """A weight, or the first of a sequence of experts."""
    return w if isinstance(w, (torch.Tensor, Fp8Weight)) else w[0]


def kernels_take(*weights: Any) -> bool:
    """Whether the Triton kernels take these weights as they are stored (linears, or experts
    as a stack or a sequence): all plain tensors (the bf16 kernels), or all fp8 that
    `kernel_reads`. Else the caller takes its torch path, whose fp8 products dequantize
    (linear_fp8): a mix never comes from a family's loader, and the blocks kernel_reads
    refuses are the cuts it names."""
    first = [_one(w) for w in weights]
    if all(isinstance(w, torch.Tensor) for w in first):
        return True
    return all(isinstance(w, Fp8Weight) and kernel_reads(w) for w in first)


def kernels_take_ffn(w1: Any, w3: Any, w2: Any) -> bool:
    """kernels_take for a gated FFN's (or its experts') w1, w3, w2, whose gate and up the fp8
    kernels read with one block shape (halves cut from one fused weight always share one)."""
    if not kernels_take(w1, w3, w2):
        return False
    a, b = _one(w1), _one(w3)
    return not isinstance(a, Fp8Weight) or a.block == b.block
