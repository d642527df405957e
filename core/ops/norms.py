"""RMSNorm as the transformers reference computes it (torch reference, the CPU path).

`weight * cast(x_fp32 * rsqrt(mean(x_fp32²) + eps))`: normalised in fp32, rounded to x's dtype,
then scaled in the weight's dtype. Each row reduces only its own last dimension, so a row's
result does not depend on the other rows of the pass.
"""

from __future__ import annotations

import torch

from .gpu import use_triton
from .slot_sum import SlotSum


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> [..., D] (dtype: x's and weight's promoted)."""
    if use_triton(x):
        from .triton_norms import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
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
