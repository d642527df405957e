"""Gemma 4's audio tower and its projection into the text embedding, as modeling_gemma4.py
(5.23.0) computes them: Gemma4AudioModel (subsampling convs, Conformer layers, output projection)
and Gemma4MultimodalEmbedder (`embed_audio`). Torch only.

Input is one clip's log-mel features [T, mel] (audio_features.py). The reference runs a batch
padded, zeroing padded frames before each subsampling conv and masking padded keys; its layers
are otherwise per frame or causal (the depthwise conv), so a clip run alone on its valid frames
gives the rows the batch gives it: its soft tokens depend on no other clip. A clip of T frames
gives ceil(ceil(T / 2) / 2) soft tokens (two stride-2 convs).

Attention is chunked and local: queries in chunks of C, each chunk seeing the C + P + F keys from
P before its start to F after its end (P = context_left - 1, F = context_right), of which the
reference's sliding-window mask keeps 0 <= q - k < context_left - 1 and 0 < k - q < context_right
(one fewer on each side than the window holds). Logits add a Transformer-XL relative-position
term, are soft-capped, and masked keys get `attention_invalid_logits_value`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tensorfold.ops.linear import linear

from .audio_config import AudioConfig
from .audio_weights import AudioLayerWeights, AudioWeights, FeedForwardWeights
from .ops import rms_norm
from .vision import clipped

NORM_EPS = 1e-6  # the reference builds the layers' and feed-forwards' RMSNorms at their default


def audio_embeddings(cfg: AudioConfig, w: AudioWeights, features: torch.Tensor) -> torch.Tensor:
    """One clip's soft tokens in the text embedding: embed_audio(tower(features)) -> [T'', text
    H] in the weights' dtype. features [T, mel] fp32."""
    h = encode(cfg, w, features)
    return linear(rms_norm(h, None, cfg.rms_norm_eps), w.projection)


def encode(cfg: AudioConfig, w: AudioWeights, features: torch.Tensor) -> torch.Tensor:
    """The subsampling convs, the Conformer layers and the output projection over one clip:
    features [T, mel] -> [T'', output_proj_dims] in the weights' dtype."""
    h = subsample(cfg, w, features)
    rel = relative_positions(cfg, h.device, h.dtype)
    mask = local_mask(cfg, h.shape[0], h.device)
    for layer in w.layers:
        h = conformer_layer(cfg, layer, h, rel, mask)
    return linear(h, w.output_proj, w.output_bias)


def subsample(cfg: AudioConfig, w: AudioWeights, features: torch.Tensor) -> torch.Tensor:
    """Two (conv 3x3 stride 2, LayerNorm over channels, ReLU) over [T, mel] as one channel,
    then the channels of each frame flattened (mel-major) and projected: -> [T'', Ha]."""
    x = features.to(w.conv0.dtype)[None, None]  # [1, 1, T, mel]
    for conv, norm in ((w.conv0, w.conv0_norm), (w.conv1, w.conv1_norm)):
        x = F.conv2d(x, conv, stride=2, padding=1).permute(0, 2, 3, 1)  # [1, T', mel', C]
        x = F.layer_norm(x, (x.shape[-1],), norm.to(x.dtype), None, cfg.rms_norm_eps)
        x = torch.relu(x).permute(0, 3, 1, 2)
    x = x[0].permute(1, 2, 0)  # [T'', mel'', C1]
    return linear(x.reshape(x.shape[0], -1), w.input_proj)


def relative_positions(cfg: AudioConfig, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Sinusoidal embeddings of the relative distances context//2 ... 0, [sin | cos] over
    Ha/2 timescales each (Gemma4AudioRelPositionalEncoding): [context//2 + 1, Ha]."""
    half = cfg.hidden_size // 2
    step = math.log(10000.0) / max(half - 1, 1)
    inv = torch.exp(torch.arange(half, device=device) * -step)
    pos = torch.arange(cfg.context_size // 2, -1, -1, device=device)[:, None]
    t = pos * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=-1).to(dtype)


def local_mask(cfg: AudioConfig, n: int, device: torch.device) -> torch.Tensor:
    """Which keys each query may not see, in the chunked layout: [blocks, C, context] bool,
    True where masked (outside the clip or outside the reference's sliding window)."""
    c, past = cfg.attention_chunk_size, cfg.attention_context_left - 1
    blocks = -(-n // c)
    q = torch.arange(blocks * c, device=device).view(blocks, c, 1)
    start = torch.arange(blocks, device=device).view(blocks, 1, 1) * c - past
    k = start + torch.arange(cfg.context_size, device=device).view(1, 1, -1)
    dist = q - k
    seen = ((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < cfg.attention_context_right))
    return ~(seen & (k >= 0) & (k < n))


def conformer_layer(
    cfg: AudioConfig,
    w: AudioLayerWeights,
    h: torch.Tensor,
    rel: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Gemma4AudioLayer: half-step feed-forward, attention, light conv, feed-forward, norm.
    h [N, Ha] -> [N, Ha]."""
    clip = min(cfg.gradient_clipping, torch.finfo(h.dtype).max)
    h = feed_forward(cfg, w.ffn1, h)
    a = rms_norm(torch.clamp(h, -clip, clip), w.norm_pre_attn, NORM_EPS)
    a = attention(cfg, w, a, rel, mask)
    h = h + rms_norm(torch.clamp(a, -clip, clip), w.norm_post_attn, NORM_EPS)
    h = light_conv(cfg, w, h)
    h = feed_forward(cfg, w.ffn2, h)
    return rms_norm(torch.clamp(h, -clip, clip), w.norm_out, NORM_EPS)


def feed_forward(cfg: AudioConfig, w: FeedForwardWeights, h: torch.Tensor) -> torch.Tensor:
    """Gemma4AudioFeedForward: h + residual_weight · norm(down(silu(up(norm(h)))))."""
    clip = min(cfg.gradient_clipping, torch.finfo(h.dtype).max)
    x = rms_norm(torch.clamp(h, -clip, clip), w.pre_norm, NORM_EPS)
    x = clipped(F.silu(clipped(x, w.up)), w.down)
    x = rms_norm(torch.clamp(x, -clip, clip), w.post_norm, NORM_EPS)
    return x * cfg.residual_weight + h


def light_conv(cfg: AudioConfig, w: AudioLayerWeights, h: torch.Tensor) -> torch.Tensor:
    """Gemma4AudioLightConv1d: h + end(silu(norm(causal depthwise conv(glu(start(norm(h)))))))."""
    x = rms_norm(h, w.conv_pre_norm, cfg.rms_norm_eps)
    x = F.glu(clipped(x, w.conv_start), dim=-1)  # [N, Ha]
    k = cfg.conv_kernel_size
    x = F.conv1d(F.pad(x.t()[None], (k - 1, 0)), w.depthwise, groups=x.shape[-1])[0].t()
    clip = min(cfg.gradient_clipping, torch.finfo(x.dtype).max)
    x = rms_norm(torch.clamp(x, -clip, clip), w.conv_norm, cfg.rms_norm_eps)
    return clipped(F.silu(x), w.conv_end) + h


def attention(
    cfg: AudioConfig,
    w: AudioLayerWeights,
    x: torch.Tensor,
    rel: torch.Tensor,
    mask: torch.Tensor,
) -> torch.Tensor:
    """Gemma4AudioAttention over one clip, in fp32: x [N, Ha] -> [N, Ha]."""
    n, heads, d = x.shape[0], cfg.num_attention_heads, cfg.head_dim
    c, past, future = (
        cfg.attention_chunk_size,
        cfg.attention_context_left - 1,
        cfg.attention_context_right,
    )
    blocks = -(-n // c)
    q_scale = (d**-0.5) / math.log(2)
    k_scale = math.log(1 + math.e) / math.log(2)
    q = clipped(x, w.q).float().view(n, heads, d) * q_scale * F.softplus(w.per_dim_scale)
    k = clipped(x, w.k).float().view(n, heads, d) * k_scale
    v = clipped(x, w.v).float().view(n, heads, d)
    q = F.pad(q, (0, 0, 0, 0, 0, blocks * c - n)).view(blocks, c, heads, d)
    k, v = (_contexts(cfg, t, past, future) for t in (k, v))  # [blocks, context, heads, d]
    qh = q.permute(2, 0, 1, 3)  # [heads, blocks, C, d]
    content = qh @ k.permute(2, 0, 3, 1)  # [heads, blocks, C, context]
    rel_k = linear(rel, w.relative_k).view(-1, heads, d).float()  # [R, heads, d]
    position = (qh.reshape(heads, -1, d) @ rel_k.permute(1, 2, 0)).view(heads, blocks, c, -1)
    scores = content + _rel_shift(cfg, position)
    cap = cfg.attention_logit_cap
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(mask, cfg.attention_invalid_logits_value)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    out = probs @ v.permute(2, 0, 1, 3)  # [heads, blocks, C, d]
    out = out.permute(1, 2, 0, 3).reshape(blocks * c, heads * d)[:n]
    return clipped(out.to(x.dtype), w.post)


def _contexts(cfg: AudioConfig, t: torch.Tensor, past: int, future: int) -> torch.Tensor:
    """Each chunk's window of keys (zero outside the clip): t [N, heads, d] -> [blocks,
    context, heads, d], window b covering frames b·C - past ... b·C + C - 1 + future."""
    c = cfg.attention_chunk_size
    t = F.pad(t, (0, 0, 0, 0, past, future + c - 1))
    return t.unfold(0, cfg.context_size, c).movedim(-1, 1)


def _rel_shift(cfg: AudioConfig, x: torch.Tensor) -> torch.Tensor:
    """Transformer-XL's shift of position logits [heads, blocks, C, R] onto the chunk's key
    window: -> [heads, blocks, C, context], query i of a chunk at window key j getting the
    logit of distance i + past - j."""
    heads, blocks, c, r = x.shape
    ctx = cfg.context_size
    x = F.pad(x, (0, ctx + 1 - r)).view(heads, blocks, c * (ctx + 1))
    return x[..., : c * ctx].view(heads, blocks, c, ctx)
