"""GLM-5.3-Flash's vision tower (torch): pixel rows in, image embeddings out, as transformers
5.23.0 `Glm5NextVisionModel` computes them (`get_image_features`' pooler_output).

Input as the image processor gives it: pixel_values [patches, C·T·P·P], each image's patches in
its grid's block-major order (2 x 2 merge blocks, each block's patches row by row), and grid_thw
[images, 3] (t, h, w in patches). Per image: the patch embedding, `depth` ViT blocks (RMSNorm;
qkv with bias, per-head q/k RMSNorm, 2-D axial RoPE, attention within the image; SwiGLU clamped
at ±swiglu_limit), the post-RMSNorm, each 2 x 2 block of patches mapped to one out_hidden_size
row (the Conv2d downsample), and the merger (linear, LayerNorm, exact GELU, clamped SwiGLU).
The rows of all images, in order, are what the reference's masked_scatter writes over the
placeholder tokens' rows.

Several images run in one pass: their patches one after another through the products (fixed
row blocks, tensorfold.ops.linear) and the norms (row by row), attention within each image
alone, so an image's embeddings are the same bits whatever images share its pass. Attention
never holds an [n, n] score matrix: on CUDA torch's fused attention, on the CPU blocks of
queries whose fp32 scores fit vision_memory.SCORE_BYTES (vision_memory.py counts what a tower
pass holds).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tensorfold.ops.linear import linear
from tensorfold.ops.moe import silu
from tensorfold.ops.norms import rms_norm

from . import vision_memory
from .ops import layer_norm, softmax
from .vision_weights import VisionBlockWeights, VisionConfig, VisionWeights

__all__ = ["attend", "image_embeddings", "image_token_counts", "query_rows"]


def image_token_counts(grid_thw: torch.Tensor, cfg: VisionConfig) -> list[int]:
    """How many placeholder tokens (embedding rows) each image takes: t·h·w / merge²."""
    merge2 = cfg.spatial_merge_size**2
    return [int(t * h * w) // merge2 for t, h, w in grid_thw.tolist()]


def image_embeddings(
    w: VisionWeights, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> torch.Tensor:
    """pixel_values [patches, C·T·P·P], grid_thw [images, 3] -> [tokens, out_hidden_size] in
    the weights' dtype, the images' rows one after another, all in one pass (each image's rows
    the bits it has alone)."""
    cfg = w.cfg
    if pixel_values.shape[-1] != cfg.patch_dim:
        raise ValueError(f"pixel rows of {pixel_values.shape[-1]} values, not {cfg.patch_dim}")
    sizes = [int(t * h * w_) for t, h, w_ in grid_thw.tolist()]
    if sum(sizes) != pixel_values.shape[0]:
        raise ValueError(f"{pixel_values.shape[0]} pixel rows for grids of {sum(sizes)} patches")
    m = cfg.spatial_merge_size
    if any(h % m or w_ % m for _, h, w_ in grid_thw.tolist()):
        raise ValueError(f"grid_thw {grid_thw.tolist()}: h and w must be multiples of {m}")
    if not sizes:
        return pixel_values.new_empty(0, cfg.out_hidden_size, dtype=w.patch.dtype)
    x = linear(pixel_values.to(w.patch.dtype), w.patch, w.patch_bias)  # [n, D]
    ropes = [_axial_rope(cfg, int(t), int(h), int(w_), x.device) for t, h, w_ in grid_thw.tolist()]
    cos, sin = (torch.cat(parts) for parts in zip(*ropes))
    for block in w.blocks:
        x = x + _attention(block, cfg, rms_norm(x, block.norm1, cfg.rms_norm_eps), cos, sin, sizes)
        x = x + _mlp(block, cfg, rms_norm(x, block.norm2, cfg.rms_norm_eps))
    x = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
    # block-major order: each run of m·m rows is one 2 x 2 block, (y, x) row by row
    x = linear(x.reshape(-1, cfg.spatial_merge_size**2 * cfg.hidden_size), w.downsample)
    x = x + w.downsample_bias
    return _merger(w, cfg, x)


def _axial_rope(
    cfg: VisionConfig, t: int, h: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, head_dim] fp32 for the patches in block-major order: the first quarter of
    the angles from the patch's row, the second from its column, the second half a copy."""
    m = cfg.spatial_merge_size
    ys, xs = torch.meshgrid(
        torch.arange(h, device=device), torch.arange(width, device=device), indexing="ij"
    )
    blocks = (h // m, m, width // m, m)
    ys = ys.reshape(blocks).transpose(1, 2).flatten().repeat(t)
    xs = xs.reshape(blocks).transpose(1, 2).flatten().repeat(t)
    quarter = cfg.head_dim // 2
    inv_freq = 1.0 / (
        cfg.rope_theta
        ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=device) / quarter)
    )
    angles = torch.cat([ys[:, None].float() * inv_freq, xs[:, None].float() * inv_freq], -1)
    angles = torch.cat([angles, angles], -1)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half over the whole head, in fp32, rounded to x's dtype. x [n, heads, hd]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], -1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _attention(
    b: VisionBlockWeights,
    cfg: VisionConfig,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sizes: list[int],
) -> torch.Tensor:
    """Attention within each image (sizes: its patches, one image after another). Each image's
    q, k, v are fresh tensors, so attend takes the same inputs whatever rows lay around them."""
    n, heads, hd = x.shape[0], cfg.num_heads, cfg.head_dim
    q, k, v = linear(x, b.qkv, b.qkv_bias).reshape(n, 3, heads, hd).unbind(1)
    q = _rotate(rms_norm(q, b.q_norm, cfg.rms_norm_eps), cos, sin)
    k = _rotate(rms_norm(k, b.k_norm, cfg.rms_norm_eps), cos, sin)
    parts = zip(*(t.split(sizes) for t in (q, k, v)))
    o = torch.cat([attend(*(t.contiguous() for t in qkv)) for qkv in parts])  # [n, heads, hd]
    return linear(o.reshape(n, heads * hd), b.proj, b.proj_bias)


def query_rows(n: int, heads: int) -> int:
    """Queries a block of the torch attention takes: its fp32 scores [heads, rows, n] within
    vision_memory.SCORE_BYTES (the image's size alone fixes the blocks)."""
    return max(1, min(n, vision_memory.SCORE_BYTES // (heads * n * 4)))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused: bool | None = None
) -> torch.Tensor:
    """Every patch attends to every patch of its image. q, k, v [n, heads, hd] -> [n, heads, hd]
    in q's dtype. fused (default: on CUDA): torch's fused attention (flash or memory-efficient,
    no [n, n] score matrix); else scores and softmax in fp32, a block of queries at a time."""
    n, heads, hd = q.shape
    if q.is_cuda if fused is None else fused:  # on CUDA, unless told
        # [1, heads, n, hd]: the fused kernels take 4-D inputs only (else torch's math kernel)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return F.scaled_dot_product_attention(q4, k4, v4)[0].transpose(0, 1)
    keys = k.permute(1, 2, 0).float()  # [heads, hd, n]
    values = v.transpose(0, 1).float()  # [heads, n, hd]
    queries = q.transpose(0, 1).float()
    step = query_rows(n, heads)
    out = []
    for a in range(0, n, step):
        p = softmax(torch.matmul(queries[:, a : a + step], keys) / math.sqrt(hd))
        out.append(torch.matmul(p, values).to(q.dtype))
    return torch.cat(out, 1).transpose(0, 1)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _mlp(b: VisionBlockWeights, cfg: VisionConfig, x: torch.Tensor) -> torch.Tensor:
    gate = linear(x, b.gate, b.gate_bias)
    up = linear(x, b.up, b.up_bias)
    return linear(_clamped_swiglu(gate, up, cfg.swiglu_limit), b.down, b.down_bias)


def _merger(w: VisionWeights, cfg: VisionConfig, x: torch.Tensor) -> torch.Tensor:
    x = linear(x, w.merger_proj)
    x = F.gelu(layer_norm(x, w.merger_norm, w.merger_norm_bias, 1e-5))
    gate, up = linear(x, w.merger_gate), linear(x, w.merger_up)
    return linear(_clamped_swiglu(gate, up, cfg.swiglu_limit), w.merger_down)
