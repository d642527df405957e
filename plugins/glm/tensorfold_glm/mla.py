"""MLA over the cached latent, restricted to the DSA index set (`Glm5NextTextAttention`,
modeling_glm5_next.py 1101-1276), torch reference: the CPU path.

No RoPE: the latent c = kv_a_layernorm(kv_a_proj x) [r] is the only per-token cache. Attention
runs in the absorbed form: q̃_h = W_uk,hᵀ q_h ∈ R^r, score = q̃_h · c_j / √dn (the reference's
scale, from the 256-wide heads), output W_uv,h Σ_j p_j c_j: MQA with keys = values = the latent.
The reference expands k_h = W_uk,h c_j instead; the two agree to fp32 rounding.

Exactness: keys are visited in tiles of KEY_TILE aligned to absolute positions with an online
softmax, queries in blocks of QUERY_BLOCK; a tile a query selects nothing from is an exact no-op
for it, so a row's result depends only on its own position and its stream's rows.

On the GPU (use_triton): triton_mla.sparse_mla over the indexer's chosen pools and the tail,
reading the latent through PassMeta's page tables (no host sync in a decode pass).

Under tensor parallel a rank holds whole heads of q_b, w_uk, w_uv and o (shards.py); the latent
and the indexer are whole on every rank. Heads are read from the weights, and o_proj sums the
ranks' parts before its bias (`row_linear`, the identity at one rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.ops.attention import rows_dot, weighted_rows
from tensorfold.ops.gpu import use_triton
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import rms_norm
from tensorfold.ops.parallel import row_linear

from . import indexer
from .config import GlmConfig
from .ops import head_linear
from .weights import MlaWeights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows

KEY_TILE = 128
QUERY_BLOCK = 32


def mla(
    cfg: GlmConfig,
    name: str,
    w: MlaWeights,
    x: torch.Tensor,
    fp: ForwardPass,
    rows: "PagedRows",
    shared: indexer.Selection | None,
) -> tuple[torch.Tensor, indexer.Selection]:
    """x [N, H] (normed) -> ([N, H], the keys it attended to: indexer.Selection). Writes the
    pass's latent rows to `{name}.latent` (and the indexer's rows) before attending. A "shared"
    layer (no indexer weights) attends with `shared`, the previous layer's selection."""
    n, eps = x.shape[0], cfg.rms_norm_eps
    q_resid = rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, eps)  # [N, q_lora_rank]
    q = linear(q_resid, w.q_b).view(n, -1, cfg.qk_nope_head_dim)  # [N, heads, dn]
    latent = rms_norm(linear(x, w.kv_a, w.kv_a_bias), w.kv_a_norm, eps)  # [N, r]
    if w.indexer is not None:  # the latent rows written with the indexer's
        masks = indexer.select(
            cfg, name, w.indexer, x, q_resid, fp, rows, also=[(f"{name}.latent", latent)]
        )
    elif shared is not None:
        rows.write(f"{name}.latent", fp.write_index, latent)
        masks = shared
    else:
        raise ValueError(f"{name} shares its index set, but no earlier layer computed one")
    scale = cfg.qk_nope_head_dim**-0.5
    if use_triton(x):
        from tensorfold.ops.pass_meta import pass_meta

        from .triton_mla import sparse_mla

        assert isinstance(masks, torch.Tensor)
        attended = sparse_mla(
            head_linear(q, w.w_uk),
            rows.flat(f"{name}.latent"),
            masks,
            fp.positions,
            pass_meta(fp),
            fp.page_rows,
            cfg.index_kpool,
            scale,
            rows.scales(f"{name}.latent"),
        )  # [N, heads, r]
        o = head_linear(attended, w.w_uv)
        return row_linear(o.reshape(n, -1), w.o, w.o_bias), masks
    assert isinstance(masks, list)
    q_lat = head_linear(q, w.w_uk).float()  # [N, heads, r]
    out = torch.empty_like(q_lat)
    latent, latent_scales = rows.flat(f"{name}.latent"), rows.scales(f"{name}.latent")
    for i, (lo, hi) in enumerate(fp.spans):
        idx = fp.read_index(i)
        keys = latent.index_select(0, idx).float()  # [end, r]
        key_scales = None if latent_scales is None else latent_scales.index_select(0, idx)[:, 0]
        out[lo:hi] = sparse_attention(q_lat[lo:hi], keys, masks[i], scale, key_scales)
    o = head_linear(out.to(x.dtype), w.w_uv)  # [N, heads, dv]
    return row_linear(o.reshape(n, -1), w.o, w.o_bias), masks


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stream's queries against its latent rows. q [n, heads, r] fp32; keys [end, r] fp32
    (keys = values); mask [n, end] bool (True: attend); key_scales [end]: the rows' scales when
    they are stored in fp8 (folded into the scores and the probabilities, as in
    tensorfold.ops.attention). Returns [n, heads, r] fp32."""
    n, heads, r = q.shape
    pad = (-keys.shape[0]) % KEY_TILE
    keys = F.pad(keys, (0, 0, 0, pad))
    mask = F.pad(mask, (0, pad))
    if key_scales is not None:
        key_scales = F.pad(key_scales, (0, pad))
    out = q.new_empty(n, heads, r)
    for a in range(0, n, QUERY_BLOCK):
        qb, mb = q[a : a + QUERY_BLOCK], mask[a : a + QUERY_BLOCK]
        m = qb.shape[0]
        if m < QUERY_BLOCK:  # padded rows repeat the last query; their results are dropped
            qb = torch.cat([qb, qb[-1:].expand(QUERY_BLOCK - m, -1, -1)])
            mb = torch.cat([mb, mb[-1:].expand(QUERY_BLOCK - m, -1)])
        out[a : a + m] = _block(qb, mb, keys, scale, key_scales)[:m]
    return out


def _block(
    q: torch.Tensor,
    mask: torch.Tensor,
    keys: torch.Tensor,
    scale: float,
    key_scales: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, heads, r]; mask [B, T'] (T' a multiple of KEY_TILE); keys [T', r]; key_scales
    [T'] or None -> [B, heads, r]."""
    b, heads, r = q.shape
    qh = q.reshape(b * heads, r)
    visible = mask.repeat_interleave(heads, dim=0)  # [B*heads, T'], rows as qh's
    tiles = mask.view(b, -1, KEY_TILE).any(-1).any(0).nonzero().flatten().tolist()
    run_max = q.new_full((b * heads, 1), float("-inf"))
    run_sum = q.new_zeros(b * heads, 1)
    acc = q.new_zeros(b * heads, r)
    for tile in tiles:
        t0 = tile * KEY_TILE
        kt = keys[t0 : t0 + KEY_TILE]  # [KEY_TILE, r]
        s = rows_dot(qh[None], kt[None])[0]  # not a BLAS: see rows_dot
        st = None if key_scales is None else key_scales[t0 : t0 + KEY_TILE]
        if st is not None:
            s = s * st
        s = (s * scale).masked_fill(~visible[:, t0 : t0 + KEY_TILE], float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe)
        alpha = torch.exp(run_max - safe)
        run_sum = run_sum * alpha + p.sum(-1, keepdim=True)
        pv = p if st is None else p * st
        acc = acc * alpha + weighted_rows(pv[None], kt[None])[0]
        run_max = new_max
    return (acc / run_sum).view(b, heads, r)
