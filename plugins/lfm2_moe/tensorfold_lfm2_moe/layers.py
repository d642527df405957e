"""The layers of LFM2-MoE over one pass's rows, as modeling_lfm2_moe.py (5.23.0) computes them.

Rows are a pass's flat [N, H] hidden states; the mixers reach each stream's history through its
page table (attention) or its fixed-state slot (short conv).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.ops import moe as moe_ops
from tensorfold.ops import parallel
from tensorfold.ops.attention import paged_attention
from tensorfold.ops.conv import gated_conv
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import add_rms_norm
from tensorfold.ops.rope import norm_rope, qkv_norm_rope_write

from .config import Lfm2MoeConfig
from .weights import AttentionWeights, ConvWeights, DenseWeights, MoeWeights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots


def attention(
    cfg: Lfm2MoeConfig,
    name: str,
    w: AttentionWeights,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    fp: ForwardPass,
    rows: "PagedRows",
) -> torch.Tensor:
    """GQA with per-head q/k RMSNorm before RoPE. x [N, H]; cos, sin [N, D] -> [N, H].
    Writes the pass's k/v rows to `{name}.k` / `{name}.v` before attending."""
    n, d = x.shape[0], cfg.head_dim
    k_name, v_name = f"{name}.k", f"{name}.v"
    k_rows, v_rows = rows.flat(k_name), rows.flat(v_name)  # [R, Hkv, D]
    # heads from the weights: under tensor parallel, this rank's heads
    qkv = linear(x, w.qkv).view(n, -1, d)  # [N, Hq + 2·Hkv, D]
    if k_rows.dtype == v_rows.dtype == x.dtype:  # not fp8 rows: one launch stores them
        q = qkv_norm_rope_write(
            qkv, w.q_norm, w.k_norm, cfg.norm_eps, cos, sin, k_rows, v_rows, fp.write_index
        )
    else:
        kv_heads = k_rows.shape[1]
        q, k, v = qkv.split((qkv.shape[1] - 2 * kv_heads, kv_heads, kv_heads), dim=1)
        q = norm_rope(q, w.q_norm, cfg.norm_eps, cos, sin)
        k = norm_rope(k, w.k_norm, cfg.norm_eps, cos, sin)
        rows.write_many(fp.write_index, [(k_name, k), (v_name, v)])
    o = paged_attention(
        q,
        k_rows,
        v_rows,
        fp,
        scale=d**-0.5,
        k_scales=rows.scales(k_name),
        v_scales=rows.scales(v_name),
    )
    return parallel.row_linear(o.reshape(n, -1), w.out)


def short_conv(
    name: str, w: ConvWeights, x: torch.Tensor, fp: ForwardPass, slots: "StreamSlots"
) -> torch.Tensor:
    """out_proj(C ⊙ conv(B ⊙ x)), the conv carried across passes in slot `{name}.conv`
    ([slots, H, K-1]). x [N, H] -> [N, H]. Under tensor parallel H of the conv is this rank's
    channels and out_proj sums the ranks' parts."""
    bcx = linear(x, w.in_proj, w.in_bias)  # [N, 3H]: B, C, x
    z = gated_conv(bcx, slots.get(f"{name}.conv"), fp, w.conv, w.conv_bias, tap_name=f"{name}.conv")
    return parallel.row_linear(z, w.out_proj, w.out_bias)


def norm_feed_forward(
    cfg: Lfm2MoeConfig,
    w: DenseWeights | MoeWeights,
    norm: torch.Tensor,
    y: torch.Tensor,
    h: torch.Tensor,
) -> "tuple[torch.Tensor | moe_ops.SlotSum, torch.Tensor]":
    """h = y + h and the FFN of rms_norm(h) (weight `norm`), [N, H] each: (the dense SwiGLU's
    or the sigmoid-routed MoE's output, its slots left for the next add_rms_norm to sum as a
    moe_ops.SlotSum; h). The MoE's norm and router go through moe_ops.norm_route, which can
    run them as one launch in a decode round of one stream (triton_route.norm_route)."""
    if isinstance(w, DenseWeights):  # w2 row-parallel under tensor parallel
        x, h = add_rms_norm(y, h, norm, cfg.norm_eps)
        return parallel.sum_partials(moe_ops.gated_ffn(x, w.w1, w.w3, w.w2)), h
    x, h, weights, experts = moe_ops.norm_route(
        y,
        h,
        norm,
        cfg.norm_eps,
        w.gate,
        w.expert_bias,
        cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor,
    )
    if parallel.current().world > 1:  # this rank's experts, the ranks' partials summed
        return parallel.expert_parallel_moe(
            x, weights, experts, w.w1, w.w3, w.w2, w.first_expert
        ), h
    return moe_ops.moe(x, weights, experts, w.w1, w.w3, w.w2, sum_slots=False), h
