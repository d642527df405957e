"""A round's logits rows reduced on the GPU in one launch: each row's first maximum (the greedy
token), the maximum and the log of Σ exp(x - max), from which every logprob of the row follows
as (x - max) - log_sum. A program walks CHUNK ids of a row in BLOCK steps with a running
maximum and a rescaled running sum per lane; a row of more ids takes several programs, whose
(max, first id, sum) the row's last program to arrive folds in order (an arrival counter, as
the split GEMVs do). The chunks depend on V alone, so a row's result never depends on the other
rows. The sampler's torch path (log_softmax, argmax, gather, cat: about ten launches a round)
stays for the CPU; `row_stats_reference` is this kernel's arithmetic in torch, for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import triton_splitk as splitk
from .gpu import launch_options
from .triton_util import after_prior, interpreting, publish_writes

BLOCK = 1024
WARPS = 8
CHUNK = 32768  # ids a program walks: a row of more ids spreads over several programs (below)


def parts_of(v: int) -> int:
    """Programs a row of v ids takes: a function of V alone, so a row's sums never depend on
    the round (gemma4's 262144 ids: 8 programs; lfm2's 65536: 2)."""
    return -(-v // CHUNK)


@triton.jit
def _chunk_stats(x_ptr, row, lo, hi, stride_x, BLOCK: tl.constexpr):
    """Ids [lo, hi) of a row, BLOCK lanes wide: (max, first id of the max, Σ exp(x - max))."""
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    idx = tl.zeros((BLOCK,), dtype=tl.int32)
    for v0 in range(lo, hi, BLOCK):
        col = v0 + lanes
        x = tl.load(x_ptr + row * stride_x + col, mask=col < hi, other=float("-inf")).to(tl.float32)
        better = x > m  # strict: a lane keeps its first maximum
        new_m = tl.maximum(m, x)
        # the lane's sum rescaled to its new maximum (a lane still at -inf holds 0)
        s = tl.where(new_m == float("-inf"), 0.0, s * tl.exp(m - new_m) + tl.exp(x - new_m))
        idx = tl.where(better, col, idx)
        m = new_m
    top = tl.max(m, axis=0)
    first = tl.min(tl.where(m == top, idx, hi), axis=0)  # ties to the lowest id
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), axis=0)
    return top, first, total


@triton.jit(do_not_specialize=["B"])
def _row_stats_kernel(
    x_ptr,
    tok_ptr,
    both_ptr,
    max_ptr,
    lse_ptr,
    ws_ptr,
    cnt_ptr,
    B,
    V,
    stride_x,
    CHUNK,
    PARTS: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    lo = part * CHUNK
    top, first, total = _chunk_stats(x_ptr, row, lo, tl.minimum(V, lo + CHUNK), stride_x, BLOCK)
    finish = True
    if PARTS > 1:  # each part's (max, first, sum) to the workspace; the row's last folds them
        at = ws_ptr + (row * PARTS + part) * 3
        tl.store(at, top)
        tl.store(at + 1, first.to(tl.float32))  # ids < 2**24: exact in fp32
        tl.store(at + 2, total)
        publish_writes(INTERP)
        arrived = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
        finish = arrived == PARTS - 1
        if finish:
            base = ws_ptr + row * PARTS * 3
            top = tl.load(base, volatile=True)
            first = tl.load(base + 1, volatile=True).to(tl.int32)
            for p in tl.static_range(1, PARTS):  # in part order: the lower id wins a tie
                top_p = tl.load(base + p * 3, volatile=True)
                first = tl.where(
                    top_p > top, tl.load(base + p * 3 + 1, volatile=True).to(tl.int32), first
                )
                top = tl.maximum(top, top_p)
            total = tl.zeros((), dtype=tl.float32)
            for p in tl.static_range(PARTS):
                top_p = tl.load(base + p * 3, volatile=True)
                sum_p = tl.load(base + p * 3 + 2, volatile=True)
                total += tl.where(top_p == float("-inf"), 0.0, sum_p * tl.exp(top_p - top))
            tl.atomic_xchg(cnt_ptr + row, 0)
    if finish:
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
    if v >= 1 << 24:
        raise ValueError(f"row_stats takes rows of fewer than 2**24 ids (exact in fp32), got {v}")
    dev = x.device
    tokens = torch.empty(b, dtype=torch.int64, device=dev)
    both = torch.empty(b, 2, dtype=torch.float64, device=dev)
    top = torch.empty(b, dtype=torch.float32, device=dev)
    log_sum = torch.empty(b, dtype=torch.float32, device=dev)
    parts = parts_of(v)
    if b:
        ws = torch.empty(b, parts, 3, dtype=torch.float32, device=dev) if parts > 1 else top
        cnt = splitk.counters(dev, b) if parts > 1 else tokens
        _row_stats_kernel[(b, parts)](
            x,
            tokens,
            both,
            top,
            log_sum,
            ws,
            cnt,
            b,
            v,
            x.stride(0),
            CHUNK,
            PARTS=parts,
            BLOCK=BLOCK,
            INTERP=interpreting(),
            num_warps=WARPS,
            **launch_options(x),
        )
    return tokens, both, top, log_sum


def row_stats_reference(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_stats in torch: each chunk of CHUNK ids lane by lane as a program walks it, then the
    chunks folded in order as the row's last program folds them (x [B, V])."""
    b, v = x.shape
    xf = x.to(torch.float32)
    tops, firsts, totals = [], [], []
    for lo in range(0, v, CHUNK):
        t, f, s = _chunk_reference(xf[:, lo : lo + CHUNK], lo)
        tops.append(t)
        firsts.append(f)
        totals.append(s)
    top, first = tops[0], firsts[0]
    for t, f in zip(tops[1:], firsts[1:]):
        first = torch.where(t > top, f, first)
        top = torch.maximum(top, t)
    total = torch.zeros_like(top)
    for t, s in zip(tops, totals):
        total = total + torch.where(t == float("-inf"), torch.zeros_like(s), s * torch.exp(t - top))
    log_sum = torch.log(total)  # one chunk: 0 + s·exp(0) is s
    both = torch.stack([first.to(torch.float64), (0.0 - log_sum).to(torch.float64)], 1)
    return first, both, top, log_sum


def _chunk_reference(xf: torch.Tensor, lo: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, v = xf.shape
    steps = -(-v // BLOCK)
    pad = torch.full((b, steps * BLOCK), float("-inf"), dtype=torch.float32, device=xf.device)
    pad[:, :v] = xf
    m = torch.full((b, BLOCK), float("-inf"), dtype=torch.float32, device=xf.device)
    s = torch.zeros(b, BLOCK, dtype=torch.float32, device=xf.device)
    idx = torch.zeros(b, BLOCK, dtype=torch.int64, device=xf.device)
    lanes = torch.arange(BLOCK, device=xf.device)
    for j in range(steps):
        xj = pad[:, j * BLOCK : (j + 1) * BLOCK]
        new_m = torch.maximum(m, xj)
        s = torch.where(
            new_m == float("-inf"),
            torch.zeros_like(s),
            s * torch.exp(m - new_m) + torch.exp(xj - new_m),
        )
        idx = torch.where(xj > m, lo + j * BLOCK + lanes, idx)
        m = new_m
    top = m.max(1).values
    first = torch.where(m == top[:, None], idx, torch.full_like(idx, lo + v)).min(1).values
    scaled = torch.where(m == float("-inf"), torch.zeros_like(s), s * torch.exp(m - top[:, None]))
    return top, first, scaled.sum(1)
