"""Sigmoid top-k routing on the GPU in Triton, as ops/moe.py's `route` computes it.

The router GEMV is split over fixed chunks of H (a program a chunk: a few rows would otherwise
wait on one long loop); then one program per ROUTE_ROWS rows sums the chunks in order, rounds
the logits to the model dtype, takes sigmoid scores in that dtype, picks the top k by
score + bias (fp32; ties to the lower expert) and renormalises the weights in slot order. The
chunks depend on H alone, so a row's result never depends on the other rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_util import interpreting, mma

ROUTE_ROWS = 16
ROUTER_SPLIT = 256  # columns of H a router program sums (fixed: part of the reduction order)


@triton.jit(do_not_specialize=["M"])  # one binary for any row count
def _router_partial_kernel(
    x_ptr, g_ptr, part_ptr, M, E, K, stride_xm,
    IEEE: tl.constexpr, INTERP: tl.constexpr, BM: tl.constexpr, EB: tl.constexpr,
    KS: tl.constexpr, BK: tl.constexpr,
):
    """Split s of the router logits: x[:, s*KS : (s+1)*KS] @ gate[:, same]ᵀ, fp32."""
    pid_m = tl.program_id(0)
    s = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    re = tl.arange(0, EB)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, EB), dtype=tl.float32)
    for k0 in tl.static_range(0, KS, BK):
        kk = s * KS + k0 + rk
        kin = kk < K
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        b = tl.load(g_ptr + re[None, :] * K + kk[:, None], mask=(re[None, :] < E) & kin[:, None],
                    other=0.0)
        acc = mma(a, b, acc, IEEE, INTERP)
    offs = (s * M + rm)[:, None].to(tl.int64) * EB + re[None, :]
    tl.store(part_ptr + offs, acc, mask=rm[:, None] < M)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _route_kernel(
    part_ptr, bias_ptr, w_ptr, e_ptr, n_rows, E, S, scaling,
    TOPK: tl.constexpr, KB: tl.constexpr, EB: tl.constexpr, HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr, ROWS: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ex = tl.arange(0, EB)
    rmask = rows < n_rows
    emask = ex < E
    dt = w_ptr.dtype.element_ty
    acc = tl.zeros((ROWS, EB), dtype=tl.float32)
    for s in range(0, S):  # the K splits, always in this order
        offs = (s * n_rows + rows)[:, None].to(tl.int64) * EB + ex[None, :]
        acc += tl.load(part_ptr + offs, mask=rmask[:, None], other=0.0)
    lg = acc.to(dt).to(tl.float32)  # the router's logits, in the model dtype
    score = (1.0 / (1.0 + tl.exp(-lg))).to(dt).to(tl.float32)
    key = score
    if HAS_BIAS:
        key = key + tl.load(bias_ptr + ex, mask=emask, other=0.0)[None, :]
    key = tl.where(emask[None, :], key, float("-inf"))
    kcol = tl.arange(0, KB)
    picked = tl.zeros((ROWS, KB), dtype=tl.int64)
    wts = tl.zeros((ROWS, KB), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        pick = tl.argmax(key, axis=1, tie_break_left=True)  # [ROWS]
        hit = ex[None, :] == pick[:, None]
        wj = tl.sum(tl.where(hit, score, 0.0), axis=1)
        key = tl.where(hit, float("-inf"), key)
        total = total + wj
        picked = tl.where(kcol[None, :] == j, pick[:, None].to(tl.int64), picked)
        wts = tl.where(kcol[None, :] == j, wj[:, None], wts)
    if NORM:
        denom = (total.to(dt).to(tl.float32) + 1e-6).to(dt).to(tl.float32)
        wts = (wts / denom[:, None]).to(dt).to(tl.float32)
    out = (wts * scaling).to(dt)
    offs = rows[:, None] * TOPK + kcol[None, :]
    m = rmask[:, None] & (kcol[None, :] < TOPK)
    tl.store(e_ptr + offs, picked, mask=m)
    tl.store(w_ptr + offs, out, mask=m)


def route(
    x: torch.Tensor, gate: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, *,
    norm_topk_prob: bool, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H]; gate [E, H]; expert_bias [E] fp32 -> (weights [N, k] in x's dtype,
    experts [N, k] long), slots in descending order of score + bias."""
    n, h = x.shape
    e = gate.shape[0]
    x = x.contiguous() if x.stride(-1) != 1 else x
    gate = gate.contiguous()
    eb = max(16, triton.next_power_of_2(e))
    splits = triton.cdiv(h, ROUTER_SPLIT)
    weights = torch.empty(n, top_k, dtype=x.dtype, device=x.device)
    experts = torch.empty(n, top_k, dtype=torch.long, device=x.device)
    if n == 0:
        return weights, experts
    part = torch.empty(splits, n, eb, dtype=torch.float32, device=x.device)
    _router_partial_kernel[(triton.cdiv(n, 64), splits)](
        x, gate, part, n, e, h, x.stride(0), IEEE=x.dtype == torch.float32,
        INTERP=interpreting(), BM=64, EB=eb, KS=ROUTER_SPLIT, BK=min(128, ROUTER_SPLIT),
        num_warps=4,
    )
    _route_kernel[(triton.cdiv(n, ROUTE_ROWS),)](
        part, expert_bias if expert_bias is not None else part, weights, experts, n, e, splits,
        float(scaling), TOPK=top_k, KB=triton.next_power_of_2(top_k), EB=eb,
        HAS_BIAS=expert_bias is not None, NORM=norm_topk_prob, ROWS=ROUTE_ROWS, num_warps=4,
    )
    return weights, experts
