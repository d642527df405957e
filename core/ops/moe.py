"""Gated FFNs and top-k mixture-of-experts dispatch (torch reference, the CPU path).

Batch invariance: every projection goes through `ops.linear`; an expert's rows are gathered and
multiplied on their own, and each row's weighted expert outputs are summed in the row's top-k
slot order (fp32 accumulation, as the reference's reshape+sum), so a row's result never depends on
which other rows share an expert. torch's own `silu`/`sigmoid` kernels round the vectorised body
and the scalar tail of a tensor differently (a row's bits would depend on its place in the pass);
`silu` and `sigmoid` here are built from `exp` and exactly rounded arithmetic instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .gpu import use_triton
from .linear import linear


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def gated_ffn(
    x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """SwiGLU: w2(silu(w1 x) · w3 x). x [n, H]; w1, w3 [I, H]; w2 [H, I] -> [n, H]."""
    if use_triton(x):
        from . import triton_moe

        return triton_moe.gated_ffn(x, w1, w3, w2)
    return linear(silu(linear(x, w1)) * linear(x, w3), w2)


def route(
    x: torch.Tensor,
    gate: torch.Tensor,
    expert_bias: torch.Tensor | None,
    top_k: int,
    *,
    norm_topk_prob: bool,
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing. x [N, H]; gate [E, H]; expert_bias [E] fp32 or None.

    Returns (weights [N, k] in x's dtype, experts [N, k] long), slots in descending score order.
    Scores s = sigmoid(gate x) in x's dtype; experts are chosen by topk(s + expert_bias) (fp32,
    as the bias is fp32), or by topk(s) without a bias; weights are s at the chosen experts,
    divided by (their sum + 1e-6) when norm_topk_prob, times `scaling`. Exact score ties are
    broken as torch.topk breaks them; the reference calls torch.topk on the same scores.
    """
    if use_triton(x):
        from . import triton_route

        return triton_route.route(
            x, gate, expert_bias, top_k, norm_topk_prob=norm_topk_prob, scaling=scaling
        )
    scores = sigmoid(linear(x, gate))  # [N, E]
    if expert_bias is not None:
        experts = torch.topk(scores + expert_bias, top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    else:
        weights, experts = torch.topk(scores, top_k, dim=-1)
    if norm_topk_prob:
        total = weights[:, 0].float()
        for j in range(1, top_k):
            total = total + weights[:, j].float()
        weights = weights / (total.to(weights.dtype)[:, None] + 1e-6)
    return weights * scaling, experts


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
) -> torch.Tensor:
    """x [N, H]; weights, experts [N, k]; expert e is gated_ffn(·, w1[e], w3[e], w2[e]).

    Returns Σ_j weights[:, j] · expert_{experts[:, j]}(x) [N, H] in x's dtype, summed over j in
    slot order."""
    if use_triton(x):
        from . import triton_moe

        return triton_moe.moe(x, weights, experts, w1, w3, w2)
    n, k = experts.shape
    flat = experts.reshape(-1)  # [N*k], entry r*k + j is row r's slot j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w1)).tolist()
    slots = x.new_empty(n * k, x.shape[1])
    flat_weights = weights.reshape(-1)
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        picks = order[start : start + count]
        start += count
        y = gated_ffn(x.index_select(0, picks // k), w1[e], w3[e], w2[e])
        slots[picks] = y * flat_weights[picks, None]
    per_slot = slots.view(n, k, -1)
    acc = per_slot[:, 0].float()
    for j in range(1, k):
        acc = acc + per_slot[:, j].float()
    return acc.to(x.dtype)
