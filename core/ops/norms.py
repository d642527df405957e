"""RMSNorm as the transformers reference computes it (torch reference, the CPU path).

`weight * cast(x_fp32 * rsqrt(mean(x_fp32²) + eps))`: normalised in fp32, rounded to x's dtype,
then scaled in the weight's dtype (LlamaRMSNorm); with `fp32_weight`, `cast(weight_fp32 *
x_fp32 * rsqrt(...))`, rounded once (Olmo2RMSNorm). Each row reduces only its own last dimension, so a row's
result does not depend on the other rows of the pass.
"""

from __future__ import annotations

import torch

from .gpu import use_triton
from .slot_sum import SlotSum


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, fp32_weight: bool = False
) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] (dtype: x's and weight's promoted).

    fp32_weight: the weight multiplies in fp32 and the product is rounded once, to x's dtype:
    `(w_fp32 · x̂).to(x.dtype)` (OLMo 2's and Gemma 4's RMSNorm), where the default rounds x̂
    first and scales in the weight's dtype. One launch on the GPU either way."""
    if use_triton(x):
        from .triton_norms import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps, fp32_weight=fp32_weight)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    if fp32_weight:
        return (weight.float() * (xf * torch.rsqrt(variance + eps))).to(x.dtype)
    return weight * (xf * torch.rsqrt(variance + eps)).to(x.dtype)


def add_rms_norm(
    x: "torch.Tensor | SlotSum", residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; returns (rms_norm(h), h). x, residual [..., D] of one dtype; x may be a
    MoE's unsummed slots (moe.SlotSum), summed first."""
    if isinstance(x, SlotSum):
        if use_triton(x.slots) and x.slots.shape[-2] > 1:
            from .triton_norms import add_rms_norm as triton_add_rms_norm

            return triton_add_rms_norm(x.slots, residual, weight, eps, slots=x.slots.shape[-2])
        x = x.total()
    if use_triton(x):
        from .triton_norms import add_rms_norm as triton_add_rms_norm

        return triton_add_rms_norm(x, residual, weight, eps)
    h = x + residual
    return rms_norm(h, weight, eps), h
