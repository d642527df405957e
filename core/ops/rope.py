"""Rotary position embeddings, NeoX style (rotate-half over the whole head), from absolute
positions (torch reference, the CPU path).

cos/sin are computed in fp32 from `position * inv_freq` and cast to the model dtype before they
touch q and k, as the transformers reference does. Every op here is elementwise per position, so
a row's rotation never depends on which other positions share the pass.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import torch

from ..family.rope_config import ROPE_TYPES, RopeRefused
from .gpu import use_triton


def inv_freq(head_dim: int, theta: float, device: str | torch.device = "cpu") -> torch.Tensor:
    """[head_dim // 2] fp32: theta^(-2i/head_dim)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponents)


def scaled_inv_freq(
    head_dim: int, params: Mapping[str, Any], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """[head_dim // 2] fp32 for `params` (family.rope_config.rope_parameters' answer: a
    rope_type of ROPE_TYPES, RopeRefused for another), as transformers 5.23.0's
    modeling_rope_utils computes it: "default" inv_freq(head_dim, rope_theta); "linear" that
    divided by `factor`; "llama3" (Llama 3.1) low frequencies (wavelength past
    original_max_position_embeddings / low_freq_factor) divided by `factor`, high ones (past
    / high_freq_factor) kept, those between blended. Each scales the angle only (cos and sin
    are not rescaled), so cos_sin and apply_rope run as for default RoPE."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise RopeRefused(f"rope_type {rope_type!r} is not implemented; accepted: {ROPE_TYPES}")
    freqs = inv_freq(head_dim, float(params["rope_theta"]), device)
    if rope_type == "linear":
        return freqs / params["factor"]
    if rope_type == "default":
        return freqs
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    long = torch.where(wavelen > context / low, freqs / factor, freqs)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * long / factor + smooth * long
    between = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(between, blended, long)


def cos_sin(
    positions: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] (absolute), freqs [D/2] fp32 -> cos, sin [N, D] in `dtype`."""
    angles = positions.float()[:, None] * freqs[None, :]  # [N, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D]; cos, sin [N, D] -> [N, H, D]: x·cos + rotate_half(x)·sin."""
    if use_triton(x) and x.dtype == cos.dtype:
        from .triton_rope import apply_rope as triton_apply_rope

        return triton_apply_rope(x, cos, sin)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return (x * cos) + (rotate_half(x) * sin)


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    fp32_weight: bool = False,
    norm: "Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None" = None,
) -> torch.Tensor:
    """apply_rope(norm(x, weight, eps), cos, sin): each head of x [N, H, D] RMS-normalised, then
    rotated; weight [D]; cos, sin [N, D]. norm: the family's RMSNorm (default ops.norms.rms_norm:
    w · round(x̂)); fp32_weight says which the GPU's one launch computes: x̂·w in fp32 rounded
    once (Gemma4RMSNorm, an fp32 weight), or w · round(x̂). x̂ = x·rsqrt(mean(x²) + eps) in fp32."""
    if (
        use_triton(x)
        and x.dtype == cos.dtype
        and (not fp32_weight or weight.dtype == torch.float32)
    ):
        from .triton_rope import norm_rope as triton_norm_rope

        return triton_norm_rope(x, weight, eps, cos, sin, fp32_weight)
    if norm is None:
        from .norms import rms_norm

        norm = rms_norm
    return apply_rope(norm(x, weight, eps), cos, sin)


def qkv_heads(
    heads: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    v_first: int,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    norm: "Callable[[torch.Tensor, torch.Tensor | None, float], torch.Tensor]",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer's q, k and v heads from one product's heads [N, *, D], each head
    normalised by `norm` (an fp32 weight: x̂·w in fp32 rounded once) and q and k rotated:
    q = norm_rope(heads[:, :q_heads], q_norm), k = norm_rope(the next kv_heads, k_norm), and
    v = norm(the kv_heads from v_first, None) (v_first = q_heads: V from the raw k heads).
    One launch on the GPU (gemma4's q/k/v norms; three launches before)."""
    if (
        use_triton(heads)
        and heads.dtype == cos.dtype
        and q_norm.dtype == k_norm.dtype == torch.float32
    ):
        from .triton_rope import qkv_heads as triton_qkv_heads

        return triton_qkv_heads(heads, q_heads, kv_heads, v_first, q_norm, k_norm, eps, cos, sin)
    k = heads[:, q_heads : q_heads + kv_heads]
    return (
        norm_rope(heads[:, :q_heads], q_norm, eps, cos, sin, fp32_weight=True, norm=norm),
        norm_rope(k, k_norm, eps, cos, sin, fp32_weight=True, norm=norm),
        norm(heads[:, v_first : v_first + kv_heads], None, eps),
    )


def qkv_norm_rope_write(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    index: torch.Tensor,
) -> torch.Tensor:
    """An attention layer's q heads for attention and its new K/V rows stored: qkv [N, Hq +
    2·Hkv, D] holds each row's q, k and v heads; returns norm_rope(q, q_norm, eps, cos, sin)
    [N, Hq, D] and writes norm_rope(k, k_norm, ...) into k_dst [R, Hkv, D] and v into v_dst at
    rows index [N] (the norm w · round(x̂)). k_dst and v_dst hold qkv's dtype (fp8 rows are
    quantized by their own writer: PagedRows.write_many)."""
    kv_heads = k_dst.shape[1]
    if use_triton(qkv) and qkv.dtype == cos.dtype:
        from .triton_rope import qkv_norm_rope_write as triton_qkv_norm_rope_write

        return triton_qkv_norm_rope_write(qkv, q_norm, k_norm, eps, cos, sin, k_dst, v_dst, index)
    q, k, v = qkv.split((qkv.shape[1] - 2 * kv_heads, kv_heads, kv_heads), dim=1)
    k_dst.index_copy_(0, index, norm_rope(k, k_norm, eps, cos, sin))
    v_dst.index_copy_(0, index, v)
    return norm_rope(q, q_norm, eps, cos, sin)
