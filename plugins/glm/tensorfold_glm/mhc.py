"""The manifold-constrained hyper-connection (mHC) residual: hc_mult streams per token
(`Glm5NextTextHyperConnection`, modeling_glm5_next.py 218-336).

Per token, in fp32: the flattened streams are RMS-normed (no weight), projected to
pre | post | comb logits, gated (sigmoid, 2·sigmoid, softmax), and comb is made doubly
stochastic by the reference's eps-ratio Sinkhorn (x / (sum + eps), columns first, then
iters - 1 rounds of rows and columns) — not the log-space form. No state crosses tokens.

On the GPU (`use_triton`) the collapse and the block norm after it are one Triton kernel pair,
the expand another (or, at a few rows, a sublayer's expand and the next collapse one launch),
and the streams a pass starts from and the final head one launch each (triton_mhc.py).
"""

from __future__ import annotations

import torch

from tensorfold.ops.gpu import use_triton
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import rms_norm

from .config import GlmConfig
from .ops import sigmoid, softmax
from .weights import HcWeights


def collapse(
    cfg: GlmConfig, w: HcWeights, streams: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, hc, H] -> (post [N, hc] fp32, comb [N, hc, hc] fp32, block input [N, H])."""
    n, hc, _ = streams.shape
    eps = cfg.hc_eps
    flat = streams.reshape(n, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps)
    pre_w, post_w, comb_w = linear(flat, w.fn).split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = w.base.split([hc, hc, hc * hc])
    pre = sigmoid(pre_w * w.scale[0] + pre_b) + eps
    post = 2 * sigmoid(post_w * w.scale[1] + post_b)
    comb = softmax(comb_w.view(n, hc, hc) * w.scale[2] + comb_b.view(hc, hc)) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    x = pre[:, 0, None] * streams[:, 0].float()
    for m in range(1, hc):
        x = x + pre[:, m, None] * streams[:, m].float()
    return post, comb, x.to(streams.dtype)


def collapse_norm(
    cfg: GlmConfig, w: HcWeights, streams: torch.Tensor, norm_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """collapse, then the block's RMSNorm of its input: streams [N, hc, H]; norm_weight [H] ->
    (post [N, hc] fp32, comb [N, hc, hc] fp32, normed block input [N, H])."""
    hc = streams.shape[1]
    if use_triton(streams) and hc & (hc - 1) == 0:
        from .triton_mhc import collapse_norm as fused

        return fused(
            streams,
            w.fn,
            w.base,
            w.scale,
            norm_weight,
            iters=cfg.hc_sinkhorn_iters,
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )
    post, comb, x = collapse(cfg, w, streams)
    return post, comb, rms_norm(x, norm_weight, cfg.rms_norm_eps)


def expand(
    post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """Stream j becomes post_j · y + Σ_m comb[m, j] · residual_m, in the model dtype.
    post [N, hc]; comb [N, hc, hc]; y [N, H]; residual [N, hc, H] -> [N, hc, H]."""
    if use_triton(residual):
        from .triton_mhc import expand as fused

        return fused(post, comb, y, residual)
    dtype = residual.dtype
    comb = comb.to(dtype).float()
    mixed = comb[:, 0, :, None] * residual[:, 0, None, :].float()
    for m in range(1, residual.shape[1]):
        mixed = mixed + comb[:, m, :, None] * residual[:, m, None, :].float()
    return post.to(dtype)[:, :, None] * y[:, None, :] + mixed.to(dtype)


def expand_collapse_norm(
    cfg: GlmConfig,
    w: HcWeights,
    post: torch.Tensor,
    comb: torch.Tensor,
    y: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """expand, then the next sublayer's collapse_norm (its weights w, norm_weight) of the
    streams it makes: (streams [N, hc, H], post, comb, normed block input). On the GPU a
    decode-sized pass takes one launch for both (triton_mhc.expand_collapse_norm)."""
    hc = residual.shape[1]
    if use_triton(residual) and hc & (hc - 1) == 0:
        from .triton_mhc import expand_collapse_norm as fused

        return fused(
            post,
            comb,
            y,
            residual,
            w.fn,
            w.base,
            w.scale,
            norm_weight,
            iters=cfg.hc_sinkhorn_iters,
            rms_eps=cfg.rms_norm_eps,
            hc_eps=cfg.hc_eps,
            norm_eps=cfg.rms_norm_eps,
        )
    streams = expand(post, comb, y, residual)
    return (streams, *collapse_norm(cfg, w, streams, norm_weight))


def streams_in(embed: torch.Tensor, tokens: torch.Tensor, hc: int) -> torch.Tensor:
    """The residual streams a pass starts from: each token's embedding, hc times. embed [V, H];
    tokens [N] -> [N, hc, H]."""
    if use_triton(embed):
        from .triton_mhc import streams_in as fused

        return fused(embed, tokens, hc)
    e = embed.index_select(0, tokens)  # [N, H]
    return e[:, None, :].expand(-1, hc, -1).contiguous()


def head_of_rows(streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """head of the streams of rows [R] (the pass's logit rows): [N, hc, H] -> [R, H]."""
    if use_triton(streams):
        from .triton_mhc import head as fused

        return fused(streams, rows)
    return head(streams.index_select(0, rows))


def head(streams: torch.Tensor) -> torch.Tensor:
    """The final collapse, an unweighted mean of the streams: [N, hc, H] -> [N, H]."""
    hc = streams.shape[1]
    total = streams[:, 0].float()
    for m in range(1, hc):
        total = total + streams[:, m].float()
    return (total / hc).to(streams.dtype)
