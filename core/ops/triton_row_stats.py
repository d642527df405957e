"""A round's logits rows reduced on the GPU in one launch: each row's first maximum (the greedy
token), the maximum and the log of Σ exp(x - max), from which every logprob of the row follows
as (x - max) - log_sum. One program a row walks V in BLOCK steps with a running maximum and a
rescaled running sum per lane, so a row's result never depends on the other rows. The sampler's
torch path (log_softmax, argmax, gather, cat: about ten launches a round) stays for the CPU;
`row_stats_reference` is this kernel's arithmetic in torch, for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior

BLOCK = 1024
WARPS = 8


@triton.jit(do_not_specialize=["B"])
def _row_stats_kernel(
    x_ptr, tok_ptr, both_ptr, max_ptr, lse_ptr, B, V, stride_x,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    idx = tl.zeros((BLOCK,), dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        col = v0 + lanes
        x = tl.load(x_ptr + row * stride_x + col, mask=col < V, other=float("-inf")).to(tl.float32)
        better = x > m  # strict: a lane keeps its first maximum
        new_m = tl.maximum(m, x)
        # the lane's sum rescaled to its new maximum (a lane still at -inf holds 0)
        s = tl.where(new_m == float("-inf"), 0.0,
                     s * tl.exp(m - new_m) + tl.exp(x - new_m))
        idx = tl.where(better, col, idx)
        m = new_m
    top = tl.max(m, axis=0)
    first = tl.min(tl.where(m == top, idx, V), axis=0)  # ties to the lowest id
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    log_sum = tl.log(total)
    tl.store(tok_ptr + row, first.to(tl.int64))
    tl.store(both_ptr + row * 2, first.to(tl.float64))
    tl.store(both_ptr + row * 2 + 1, (0.0 - log_sum).to(tl.float64))  # (top - top) - log_sum
    tl.store(max_ptr + row, top)
    tl.store(lse_ptr + row, log_sum)


def row_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, V] (any float dtype, rows contiguous) -> (tokens [B] int64: each row's first
    maximum; both [B, 2] float64: the token and its logprob; max [B] fp32; log_sum [B] fp32)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"row_stats takes [B, V] rows with unit stride, got {tuple(x.shape)}")
    b, v = x.shape
    dev = x.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    both = torch.empty(b, 2, dtype=torch.float64, device=dev)
    top = torch.empty(b, dtype=torch.float32, device=dev)
    log_sum = torch.empty(b, dtype=torch.float32, device=dev)
    if b:
        _row_stats_kernel[(b,)](x, tokens, both, top, log_sum, b, v, x.stride(0), BLOCK=BLOCK,
                                num_warps=WARPS, **launch_options(x))
    return tokens, both, top, log_sum


def row_stats_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_stats in torch, lane by lane as the kernel walks them (x [B, V])."""
    b, v = x.shape
    xf = x.to(torch.float32)
    steps = -(-v // BLOCK)
    pad = torch.full((b, steps * BLOCK), float("-inf"), dtype=torch.float32, device=x.device)
    pad[:, :v] = xf
    m = torch.full((b, BLOCK), float("-inf"), dtype=torch.float32, device=x.device)
    s = torch.zeros(b, BLOCK, dtype=torch.float32, device=x.device)
    idx = torch.zeros(b, BLOCK, dtype=torch.int64, device=x.device)
    lanes = torch.arange(BLOCK, device=x.device)
    for j in range(steps):
        xj = pad[:, j * BLOCK:(j + 1) * BLOCK]
        new_m = torch.maximum(m, xj)
        s = torch.where(new_m == float("-inf"), torch.zeros_like(s),
                        s * torch.exp(m - new_m) + torch.exp(xj - new_m))
        idx = torch.where(xj > m, j * BLOCK + lanes, idx)
        m = new_m
    top = m.max(1).values
    first = torch.where(m == top[:, None], idx, torch.full_like(idx, v)).min(1).values
    scaled = torch.where(m == float("-inf"), torch.zeros_like(s), s * torch.exp(m - top[:, None]))
    log_sum = torch.log(scaled.sum(1))
    both = torch.stack([first.to(torch.float64), (0.0 - log_sum).to(torch.float64)], 1)
    return first, both, top, log_sum
