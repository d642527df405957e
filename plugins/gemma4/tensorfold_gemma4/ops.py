"""Gemma 4's elementwise pieces, as modeling_gemma4.py (5.23.0) computes them, batch-invariant.

Each function is the torch reference (the CPU path) and, for tensors the Triton kernels take
(`tensorfold.ops.gpu.use_triton`), dispatches to triton_ops.py, which rounds step by step as
the reference does.

torch's own `gelu(approximate="tanh")` rounds the vectorised body and the scalar tail of a tensor
differently on the CPU (a row's bits would depend on its place in the pass); `gelu_tanh` here is
built from `tanh` and exactly rounded arithmetic, which do not. Reductions run over each row's
last dimension only.
"""

from __future__ import annotations

import math

import torch

from tensorfold.ops.gpu import use_triton

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in fp32, rounded to x's dtype. x [...]"""
    if use_triton(x):
        from .triton_ops import gelu_tanh as triton_gelu_tanh

        return triton_gelu_tanh(x)
    xf = x.float()
    inner = _GELU_C * (xf + 0.044715 * (xf * xf * xf))
    return (0.5 * xf * (1.0 + torch.tanh(inner))).to(x.dtype)


def gelu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(a) · b (the GeGLU product), each rounded to a's dtype. a, b [...] alike."""
    if use_triton(a) and a.dtype == b.dtype and a.shape == b.shape:
        from .triton_ops import gelu_mul as triton_gelu_mul

        return triton_gelu_mul(a, b)
    return gelu_tanh(a) * b


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma4RMSNorm: x·(mean(x²) + eps)^-0.5 in fp32, times the fp32 weight (scaled by w itself,
    not 1 + w; no weight: `with_scale=False`), rounded to x's dtype. x [..., D]; weight [D] fp32."""
    if use_triton(x) and (weight is None or weight.dtype == torch.float32):
        from .triton_ops import rms_norm as triton_rms_norm

        return triton_rms_norm(x, weight, eps)
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight
    return out.to(x.dtype)


def residual(
    h: torch.Tensor,
    a: torch.Tensor,
    eps: float,
    *,
    wa: torch.Tensor | None = None,
    e: torch.Tensor | None = None,
    we: torch.Tensor | None = None,
    wpost: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    wnext: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A sandwich norm's residual add, fused with what follows it in the decoder layer.
    h, a, e [N, H] in the model dtype; wa, we, wpost, wnext [H] fp32; scale [1] (layer_scalar).

        t = a, or rms_norm(a, wa)
        t = t + rms_norm(e, we)        (with e: the MoE's output beside the dense MLP's)
        t = rms_norm(t, wpost)         (with wpost)
        h' = (h + t) · scale           (with scale)
        x = rms_norm(h', wnext)        (with wnext: the next norm's input)

    Returns (h', x or None)."""
    fused = all(w is None or w.dtype == torch.float32 for w in (wa, we, wpost, wnext))
    if use_triton(h) and fused and a.dtype == h.dtype and (e is None or e.dtype == h.dtype):
        from .triton_ops import residual as triton_residual

        return triton_residual(h, a, eps, wa=wa, e=e, we=we, wpost=wpost, scale=scale, wnext=wnext)
    t = rms_norm(a, wa, eps) if wa is not None else a
    if e is not None:
        t = t + rms_norm(e, we, eps)
    if wpost is not None:
        t = rms_norm(t, wpost, eps)
    h = h + t
    if scale is not None:
        h = h * scale
    return h, (rms_norm(h, wnext, eps) if wnext is not None else None)


def residual_router(
    h: torch.Tensor,
    a: torch.Tensor,
    eps: float,
    *,
    wa: torch.Tensor,
    wnext: torch.Tensor,
    router_scale: torch.Tensor,
    const: float,
    pre_norm: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """residual(h, a, eps, wa=wa, wnext=wnext) with the MoE's inputs from h': (h', x, z, xe),
    z = rms_norm(h', None) · router_scale · const (the router's input, each product rounded)
    and xe = rms_norm(h', pre_norm) (the experts'). One launch on the GPU."""
    if (
        use_triton(h)
        and a.dtype == h.dtype
        and router_scale.dtype == h.dtype
        and all(w.dtype == torch.float32 for w in (wa, wnext, pre_norm))
    ):
        from .triton_ops import residual_router as triton_residual_router

        return triton_residual_router(
            h, a, eps, wa=wa, wnext=wnext, router_scale=router_scale, const=const, pre_norm=pre_norm
        )
    h, x = residual(h, a, eps, wa=wa, wnext=wnext)
    assert x is not None
    return h, x, rms_norm(h, None, eps) * router_scale * const, rms_norm(h, pre_norm, eps)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap·tanh(logits / cap) in logits' dtype (final_logit_softcapping); None: unchanged."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def softcap_float(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """softcap(logits, cap) as fp32 (the logits the sampler reads). logits [R, V]."""
    if cap is not None and use_triton(logits):
        from .triton_ops import softcap_float as triton_softcap_float

        return triton_softcap_float(logits, cap)
    return softcap(logits, cap).float()
