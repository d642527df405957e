"""Gemma 4's vision tower and its projection into the text embedding, as modeling_gemma4.py
(5.23.0) computes them: Gemma4VisionModel (patch embedder, encoder, pooler, standardize) and
Gemma4MultimodalEmbedder (`embed_vision`). Torch only.

Input is what Gemma 4's image processor gives: `pixel_values` [B, max_patches, 3·patch²] in [0, 1]
(each image's patches row-major, then zero padding) and `image_position_ids` [B, max_patches, 2]
holding each patch's (x, y) in its image's patch grid, (-1, -1) on padding. The reference runs the
batch padded, masking padded keys; a valid patch never sees a padded one and padded patches are
zeroed before pooling, so here only the valid patches run: several images' patches one after
another through the products (the batch-invariant `linear`) and the norms (ops.rms_norm, row by
row), attention and pooling within each image alone. An image's soft tokens are then the same
bits whatever images share its pass.

Pooling averages each k×k block of patches (k = pooling_kernel_size) into one soft token, ordered
by block index bx + (W // k)·by (W: the image's patch columns), which is row-major over the
pooled grid; blocks with no patch are dropped.
"""

from __future__ import annotations

from typing import Sequence

import torch

from tensorfold.ops.linear import linear

from .ops import gelu_mul, rms_norm
from .vision_config import QUERY_CHUNK, VisionConfig
from .vision_weights import ClippedLinear, VisionLayerWeights, VisionWeights


def image_soft_tokens(
    cfg: VisionConfig,
    w: VisionWeights,
    pixel_values: torch.Tensor,
    image_position_ids: torch.Tensor,
) -> torch.Tensor:
    """Every image's soft-token embeddings, image after image: [sum of tokens, text H] in the
    weights' dtype, the rows `masked_scatter` writes over the image placeholders in order.
    pixel_values [B, P, 3·patch²]; image_position_ids [B, P, 2] (-1 on padding)."""
    return torch.cat(images_embeddings(cfg, w, list(zip(pixel_values, image_position_ids))))


def image_embeddings(
    cfg: VisionConfig, w: VisionWeights, pixel_values: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One image's soft tokens in the text embedding: embed_vision(tower(...)) -> [T, text H].
    pixel_values [P, 3·patch²]; positions [P, 2] (rows of (-1, -1) are padding, dropped)."""
    return images_embeddings(cfg, w, [(pixel_values, positions)])[0]


def images_embeddings(
    cfg: VisionConfig, w: VisionWeights, images: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """Each image's soft tokens [T_i, text H], the images in one tower pass: image_embeddings'
    bits for each. images: (pixel_values [P, 3·patch²], positions [P, 2]) pairs."""
    if not images:
        return []
    pixels, positions = [], []
    for px, pos in images:
        valid = (pos != -1).any(-1)
        pixels.append(px[valid])
        positions.append(pos[valid].long())
    sizes = [len(pos) for pos in positions]
    h = encode(cfg, w, torch.cat(pixels), torch.cat(positions), sizes)
    soft = [pool(cfg, w, hi, pos) for hi, pos in zip(h.split(sizes), positions)]
    out = linear(rms_norm(torch.cat(soft), None, cfg.rms_norm_eps), w.projection)
    return list(out.split([len(s) for s in soft]))


def encode(
    cfg: VisionConfig,
    w: VisionWeights,
    pixel_values: torch.Tensor,
    pos: torch.Tensor,
    sizes: Sequence[int],
) -> torch.Tensor:
    """The patch embedder and the encoder layers over images' patches, one image after another.
    pixel_values [N, 3·patch²]; pos [N, 2] (x, y); sizes: each image's patches -> [N, Hv] in
    the weights' dtype."""
    dtype = w.input_proj.dtype
    x = linear((2 * (pixel_values - 0.5)).to(dtype), w.input_proj)
    h = x + (w.positions[0][pos[:, 0]] + w.positions[1][pos[:, 1]])
    cos, sin = axial_rope(cfg, pos, dtype)
    eps = cfg.rms_norm_eps
    for layer in w.layers:
        a = attention(cfg, layer, rms_norm(h, layer.input_norm, eps), cos, sin, sizes)
        h = h + rms_norm(a, layer.post_attention_norm, eps)
        m = mlp(layer, rms_norm(h, layer.pre_mlp_norm, eps))
        h = h + rms_norm(m, layer.post_mlp_norm, eps)
    return h


def pool(cfg: VisionConfig, w: VisionWeights, h: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Gemma4VisionPooler and the standardize step: the mean of each k×k block of patches (summed
    as Σ h·(1/k²) in fp32), times √Hv in fp32, then (· - std_bias)·std_scale, rounded to h's dtype.
    h [N, Hv]; pos [N, 2] -> [T, Hv], T the blocks holding a patch, by block index."""
    k = cfg.pooling_kernel_size
    n, hv = h.shape
    if n:
        width = int(pos[:, 0].max().item()) + 1
        block = pos[:, 0] // k + (width // k) * (pos[:, 1] // k)
        slot = (pos[:, 1] % k) * k + pos[:, 0] % k
        blocks = int(block.max().item()) + 1
    else:
        block = slot = pos[:, 0]
        blocks = 0
    # [blocks, k²] row indices into h, n (a zero row) where a block lacks a patch
    members = torch.full((blocks, k * k), n, dtype=torch.long, device=h.device)
    members[block, slot] = torch.arange(n, device=h.device)
    padded = torch.cat((h.float(), h.new_zeros(1, hv, dtype=torch.float32)))
    filled = (members < n).any(-1)
    sums = (padded[members[filled]] * (1.0 / (k * k))).sum(1)
    out = sums.to(h.dtype).float() * hv**0.5
    if w.std_bias is not None and w.std_scale is not None:
        out = (out - w.std_bias) * w.std_scale
    return out.to(h.dtype)


def axial_rope(
    cfg: VisionConfig, pos: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] in `dtype` for patch positions pos [N, 2]: the first D/2 channels rotate by
    x, the last D/2 by y, each half with D/4 frequencies theta^(-4i/D) (Gemma4VisionRotaryEmbedding)."""
    half = cfg.head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=pos.device) / half
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    freqs = pos[..., None].float() * inv_freq  # [N, 2, D/4]
    fx, fy = freqs[:, 0], freqs[:, 1]
    angles = torch.cat((fx, fx, fy, fy), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D] rotated in two halves (x's by x, y's by y), NeoX rotate-half within each."""
    half = x.shape[-1] // 2
    out = []
    for part in range(2):
        s = slice(part * half, (part + 1) * half)
        xp, c, si = x[..., s], cos[:, None, s], sin[:, None, s]
        x1, x2 = xp[..., : half // 2], xp[..., half // 2 :]
        out.append(xp * c + torch.cat((-x2, x1), dim=-1) * si)
    return torch.cat(out, dim=-1)


def attention(
    cfg: VisionConfig,
    w: VisionLayerWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    sizes: Sequence[int],
) -> torch.Tensor:
    """Bidirectional attention over each image's patches (sizes: each image's rows, one after
    another) with q/k norms (v without weight), 2-D RoPE on q and k, scaling
    1.0; softmax in fp32. x [N, Hv] -> [N, Hv]. Queries go in chunks of QUERY_CHUNK rows, so
    the scores take [heads, QUERY_CHUNK, N_i] at once, not [heads, N_i, N_i]
    (vision_config.VisionConfig.activation_bytes counts them)."""
    n, d, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
    q = _rotate(rms_norm(clipped(x, w.q).view(n, -1, d), w.q_norm, eps), cos, sin)
    k = _rotate(rms_norm(clipped(x, w.k).view(n, -1, d), w.k_norm, eps), cos, sin)
    v = rms_norm(clipped(x, w.v).view(n, -1, d), None, eps)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    splits = zip(*(t.split(list(sizes)) for t in (q, k, v)))
    o = torch.cat([_attend_one(qi, ki, vi) for qi, ki, vi in splits])
    return clipped(o.reshape(n, -1), w.o)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One image's attention: q, k, v [N_i, heads, D] -> [N_i, heads, D]. Each head-major copy
    is a fresh tensor, so the products take the same inputs whatever rows lay around them."""
    qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [heads, N_i, D]
    kh = kh.transpose(1, 2)
    out = []
    for a in range(0, q.shape[0], QUERY_CHUNK):
        scores = torch.matmul(qh[:, a : a + QUERY_CHUNK], kh)  # [heads, chunk, N_i]
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out.append(torch.matmul(probs, vh))  # [heads, chunk, D]
    o = torch.cat(out, dim=1) if out else qh
    return o.transpose(0, 1)


def mlp(w: VisionLayerWeights, x: torch.Tensor) -> torch.Tensor:
    """down(gelu_tanh(gate x) · up x). x [N, Hv] -> [N, Hv]."""
    return clipped(gelu_mul(clipped(x, w.gate), clipped(x, w.up)), w.down)


def clipped(x: torch.Tensor, w: ClippedLinear) -> torch.Tensor:
    """Gemma4ClippableLinear: x clamped to its input bounds, the product clamped to its output
    bounds (no bounds: the plain product). x [..., K] -> [..., N]."""
    if w.bounds is None:
        return linear(x, w.weight)
    lo, hi, out_lo, out_hi = (b.to(x.dtype) for b in w.bounds)
    return torch.clamp(linear(torch.clamp(x, lo, hi), w.weight), out_lo, out_hi)
