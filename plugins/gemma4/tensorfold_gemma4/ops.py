"""Gemma 4's elementwise pieces, as modeling_gemma4.py (5.23.0) computes them, batch-invariant.

torch's own `gelu(approximate="tanh")` rounds the vectorised body and the scalar tail of a tensor
differently on the CPU (a row's bits would depend on its place in the pass); `gelu_tanh` here is
built from `tanh` and exactly rounded arithmetic, which do not. Reductions run over each row's
last dimension only.
"""

from __future__ import annotations

import math

import torch

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in fp32, rounded to x's dtype. x [...]"""
    xf = x.float()
    inner = _GELU_C * (xf + 0.044715 * (xf * xf * xf))
    return (0.5 * xf * (1.0 + torch.tanh(inner))).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm: x·(mean(x²) + eps)^-0.5 in fp32, times the fp32 weight (scaled by w itself,
    not 1 + w; no weight: `with_scale=False`), rounded to x's dtype. x [..., D]; weight [D] fp32."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight
    return out.to(x.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(logits / cap) in logits' dtype (final_logit_softcapping); None: unchanged."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
