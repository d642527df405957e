"""Gated FFNs and top-k mixture-of-experts dispatch (torch reference, the CPU path).

Batch invariance: every projection goes through `ops.linear`; an expert's rows are gathered and
multiplied on their own, and each row's weighted expert outputs are summed in the row's top-k
slot order (fp32 accumulation, as the reference's reshape+sum), so a row's result never depends on
which other rows share an expert. torch's own `silu`/`sigmoid` kernels round the vectorised body
and the scalar tail of a tensor differently (a row's bits would depend on its place in the pass);
`silu` and `sigmoid` here are built from `exp` and exactly rounded arithmetic instead (and
`gelu_tanh` from `tanh`).

The gate's activation (`act`): "silu" (SwiGLU), "silu_clamp" (SwiGLU with the gate clamped from
above and the up product clamped to ±limit, glm5_next), "gelu_tanh" (GeGLU, gemma4).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..family.fp8_weights import Fp8Weight
from .fp8_dispatch import kernels_take_ffn
from .gpu import use_triton
from .linear import linear

# SlotSum, the MoE's output before its slot sum, lives apart so that norms need not import this
from .slot_sum import SlotSum as SlotSum
from .slot_sum import fp32_sum
from .slot_sum import summed as summed

Experts = Sequence[torch.Tensor] | Fp8Weight  # per expert [E][N, K], or a stack [E, N, K]


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (1.0 / (1.0 + torch.exp(-xf))).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in fp32, rounded to x's dtype."""
    xf = x.float()
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in fp32, rounded to x's dtype."""
    xf = x.float()
    inner = _GELU_C * (xf + 0.044715 * (xf * xf * xf))
    return (0.5 * xf * (1.0 + torch.tanh(inner))).to(x.dtype)


def glu(h1: torch.Tensor, h3: torch.Tensor, act: str, limit: float) -> torch.Tensor:
    """act(h1) · h3 in their dtype. h1 = w1 x, h3 = w3 x [n, I]."""
    if act == "silu":
        return silu(h1) * h3
    if act == "silu_clamp":
        return silu(h1.clamp(max=limit)) * h3.clamp(-limit, limit)
    if act == "gelu_tanh":
        return gelu_tanh(h1) * h3
    raise ValueError(f"unknown activation {act!r}")


def gated_ffn(
    x: torch.Tensor,
    w1: torch.Tensor | Fp8Weight,
    w3: torch.Tensor | Fp8Weight,
    w2: torch.Tensor | Fp8Weight,
    *,
    act: str = "silu",
    limit: float = 0.0,
) -> torch.Tensor:
    """w2(act(w1 x) · w3 x). x [n, H]; w1, w3 [I, H]; w2 [H, I] -> [n, H]. fp8 weights: each
    product linear_fp8's; on the GPU the fp8 form of the same kernels (triton_fp8.ffn_kernel)."""
    if use_triton(x) and kernels_take_ffn(w1, w3, w2):
        from . import triton_fp8

        return triton_fp8.ffn_kernel(x, w1, w3, w2, act=act, limit=limit)
    return linear(glu(linear(x, w1), linear(x, w3), act, limit), w2)


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
        total = fp32_sum(weights)
        weights = weights / (total.to(weights.dtype)[:, None] + 1e-6)
    return weights * scaling, experts


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
    scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = y + residual, x = rms_norm(h) (norms.add_rms_norm), then route(x, ...): returns
    (x, h, weights, experts). On the GPU a pass of one row does it in one launch."""
    if use_triton(y):
        from . import triton_route

        return triton_route.norm_route(
            y,
            residual,
            norm_weight,
            eps,
            gate,
            expert_bias,
            top_k,
            norm_topk_prob=norm_topk_prob,
            scaling=scaling,
        )
    from .norms import add_rms_norm

    x, h = add_rms_norm(y, residual, norm_weight, eps)
    return (
        x,
        h,
        *route(x, gate, expert_bias, top_k, norm_topk_prob=norm_topk_prob, scaling=scaling),
    )


def moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Experts,
    w3: Experts,
    w2: Experts,
    *,
    act: str = "silu",
    limit: float = 0.0,
    fp32_slots: bool = False,
    sum_slots: bool = True,
) -> "torch.Tensor | SlotSum":
    """x [N, H]; weights, experts [N, k]; expert e is gated_ffn(·, w1[e], w3[e], w2[e], act).

    Returns Σ_j weights[:, j] · expert_{experts[:, j]}(x) [N, H] in x's dtype, summed over j in
    slot order in fp32. Each slot's y · w (y in x's dtype) is rounded to x's dtype (lfm2), or
    kept in fp32 with fp32_slots (gemma4). sum_slots=False (not with fp32_slots): the slots
    unsummed, as a SlotSum for the next add_rms_norm. fp8 experts (Fp8Weight stacks [E, I, H],
    or sequences of Fp8Weights): the reference below, each product linear_fp8's; on the GPU the
    fp8 form of the same kernels (triton_fp8.moe_kernel)."""
    if use_triton(x) and kernels_take_ffn(w1, w3, w2):
        from . import triton_fp8

        if not sum_slots and not fp32_slots:
            return SlotSum(
                triton_fp8.moe_kernel(
                    x, weights, experts, w1, w3, w2, act=act, limit=limit, sum_slots=False
                )
            )
        return triton_fp8.moe_kernel(
            x,
            weights,
            experts,
            w1,
            w3,
            w2,
            act=act,
            limit=limit,
            slot_dtype=torch.float32 if fp32_slots else None,
        )
    dtype = torch.float32 if fp32_slots else x.dtype
    per_slot = weighted_slots(x, weights, experts, w1, w3, w2, dtype, act=act, limit=limit)
    if not sum_slots and not fp32_slots:
        return SlotSum(per_slot)
    return fp32_sum(per_slot).to(x.dtype)


def weighted_slots(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Experts,
    w3: Experts,
    w2: Experts,
    dtype: torch.dtype,
    **ffn: Any,
) -> torch.Tensor:
    """The reference's slots [N, k, H] in `dtype`: slot j of row r is weights[r, j] ·
    gated_ffn(x[r], w1[e], w3[e], w2[e], **ffn) at e = experts[r, j], each expert's rows in one
    call; a slot whose expert is len(w1) or more (another rank's: parallel.local_moe) stays
    zero."""
    n, k = experts.shape
    flat = experts.reshape(-1)  # [N*k], entry r*k + j is row r's slot j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w1)).tolist()
    slots = x.new_zeros(n * k, x.shape[1], dtype=dtype)
    flat_weights = weights.reshape(-1)
    start = 0
    for e in range(len(w1)):
        picks = order[start : start + counts[e]]
        start += counts[e]
        if len(picks):
            y = gated_ffn(x.index_select(0, picks // k), w1[e], w3[e], w2[e], **ffn)
            slots[picks] = (y * flat_weights[picks, None]).to(dtype)
    return slots.view(n, k, -1)
