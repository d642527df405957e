"""The DSA indexer with k-pool compression (`Glm5NextTextIndexer`, modeling_glm5_next.py
773-1061): which keys each MLA query attends to.

Per token (paged): kI = LayerNorm(wk x) and gI = compress_gate x. Pool p holds tokens
[kpool·p, kpool·p + kpool) (anchored at position 0: the engine never pads); its key is
K_p = Σ_j softmax_j(gI_j + ape_j) ⊙ kI_j, rebuilt from the rows as the reference rebuilds it.
Query t scores the complete pools ending at or before t, I(t, p) = Σ_h wI_h relu(qI_h · K_p / √dI),
keeps the best index_topk / kpool of them (all of them while there are no more), expands each to
its tokens, and adds its tail: the (t + 1) mod kpool tokens of its incomplete pool.

Tie rule (torch.topk's, which the reference uses, depends on the tensor's width): pools are
ranked by score, higher first, and equal scores by position, the earlier pool first.

On the GPU (use_triton) the selection is triton_indexer's instead of masks: [N, W] int32, each
row's chosen pools in ascending order, -1 padded, its tail implied by its position; the pass's
per-stream layout comes from PassMeta, so a decode pass makes no host sync. There a pool's key is
computed once, by the pass that writes the pool's last row, and kept in the paged row
`{name}.pool_key` at that row (pool_keys' arithmetic in one kernel: the same bits whichever
pass computes it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.ops.gpu import use_triton
from tensorfold.ops.linear import linear

from .config import GlmConfig
from .ops import layer_norm
from .weights import IndexerWeights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows

K_NORM_EPS = 1e-6
POOL_TILE = 64  # pools scored per product, at positions aligned to POOL_TILE

# The keys a layer's queries attend to: per stream [rows, end] bool masks (the CPU path), or on
# the GPU one [N, W] int32 tensor of chosen pools (triton_indexer.select_pools).
Selection = list[torch.Tensor] | torch.Tensor


def select(
    cfg: GlmConfig,
    name: str,
    w: IndexerWeights,
    x: torch.Tensor,
    q_resid: torch.Tensor,
    fp: ForwardPass,
    rows: "PagedRows",
    also: Sequence[tuple[str, torch.Tensor]] = (),
) -> Selection:
    """Write the pass's indexer rows to `{name}.index_k` / `{name}.index_gate` (with `also`,
    the layer's other rows for the same positions: one write, one launch on the GPU) and
    return, per stream, the keys each of its rows attends to: [rows, end] bool (on the GPU: the
    chosen pools, see Selection). On the GPU it also writes the key of each pool a row of the
    pass completes to `{name}.pool_key` (at the pool's last row); the CPU path rebuilds the
    pools' keys from the rows instead and leaves `{name}.pool_key` untouched.
    x [N, H] (normed); q_resid [N, q_lora_rank]."""
    n, heads, dim, kpool = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.index_kpool
    if use_triton(x):  # x's three maps in one product
        k_raw, gate, head_w = linear(x, w.x_maps).split([dim, dim, heads], dim=1)
    else:
        k_raw, gate, head_w = linear(x, w.wk), linear(x, w.gate), linear(x, w.weights_proj)
    rows.write_many(
        fp.write_index,
        [
            *also,
            (f"{name}.index_k", layer_norm(k_raw, w.k_norm, w.k_bias, K_NORM_EPS)),
            (f"{name}.index_gate", gate),
        ],
    )
    q = linear(q_resid, w.wq_b).view(n, heads, dim)  # [N, nI, dI]
    if use_triton(x):
        from tensorfold.ops.pass_meta import pass_meta

        from .triton_indexer import select_pools, write_pool_keys

        meta, key_rows = pass_meta(fp), rows.flat(f"{name}.pool_key")
        write_pool_keys(
            rows.flat(f"{name}.index_k"),
            rows.flat(f"{name}.index_gate"),
            w.ape,
            key_rows,
            fp.positions,
            fp.write_index,
            meta,
            fp.page_rows,
        )
        # the head weights (a column slice of x_maps) scaled as below, in the scores' launch
        return select_pools(
            q,
            head_w,
            key_rows,
            kpool,
            fp.positions,
            meta,
            fp.page_rows,
            pool_columns(fp, kpool),
            cfg.select_pools,
            dim**-0.5,
            heads**-0.5,
        )
    weights = head_w.float() * heads**-0.5  # [N, nI]
    q = q.float()
    masks = []
    for i, (stream, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        positions = fp.positions[lo:hi]
        pools = stream.end // kpool
        if pools <= cfg.select_pools:  # every candidate is kept: no score can matter
            chosen = candidates(pools, positions, kpool)
        else:
            idx = fp.read_index(i)[: pools * kpool]
            keys = rows.flat(f"{name}.index_k").index_select(0, idx).view(pools, kpool, dim)
            gates = rows.flat(f"{name}.index_gate").index_select(0, idx).view(pools, kpool, dim)
            pooled = pool_keys(keys, gates, w.ape).float()  # [P, dI]
            scores = pool_scores(q[lo:hi], weights[lo:hi], pooled, dim**-0.5)
            chosen = choose_pools(scores, candidates(pools, positions, kpool), cfg.select_pools)
        masks.append(token_mask(chosen, positions, stream.end, kpool))
    return masks


def pool_columns(fp: ForwardPass, kpool: int) -> int:
    """At least as many pools as any stream of the pass has complete, without a host sync: from
    the streams' ends in a prompt pass; in a decode pass or a uniform verify pass (a graph
    runner's static pass has placeholder streams), as many as its page tables can hold. The
    width changes no selection (the chosen pools are a set fixed by the scores, -1 padded)."""
    if not fp.rows_each and any(len(s.tokens) > 1 for s in fp.streams):
        return max(s.end for s in fp.streams) // kpool
    from tensorfold.ops.pass_meta import pass_meta

    return pass_meta(fp).table.shape[1] * fp.page_rows // kpool


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """K_p per complete pool. keys, gates [P, kpool, dI] (model dtype); ape [kpool, dI].
    The softmax weights are rounded to the keys' dtype before the product (as the reference);
    the sum over the pool's tokens runs in token order. Returns [P, dI] in the keys' dtype."""
    logits = gates.float() + ape.float()  # [P, kpool, dI]
    kpool = logits.shape[1]
    top = logits[:, 0]
    for j in range(1, kpool):
        top = torch.maximum(top, logits[:, j])
    e = torch.exp(logits - top[:, None])
    total = e[:, 0]
    for j in range(1, kpool):
        total = total + e[:, j]
    weighted = (e / total[:, None]).to(keys.dtype) * keys
    acc = weighted[:, 0].float()
    for j in range(1, kpool):
        acc = acc + weighted[:, j].float()
    return acc.to(keys.dtype)


def pool_scores(
    q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, scale: float
) -> torch.Tensor:
    """I(t, p) = Σ_h weights_h relu(q_h · K_p · scale), fp32. q [n, nI, dI]; weights [n, nI];
    pooled [P, dI] -> [n, P]. Pools are scored POOL_TILE at a time (zero-padded), so a score's
    bits depend only on its query and its pool."""
    n, heads, dim = q.shape
    total = pooled.shape[0]
    flat = q.reshape(n * heads, dim)
    out = q.new_empty(n, total)
    for p0 in range(0, total, POOL_TILE):
        tile = pooled[p0 : p0 + POOL_TILE]
        width = tile.shape[0]
        s = torch.relu(linear(flat, F.pad(tile, (0, 0, 0, POOL_TILE - width))) * scale)
        s = s.view(n, heads, POOL_TILE)
        acc = weights[:, 0, None] * s[:, 0]
        for h in range(1, heads):
            acc = acc + weights[:, h, None] * s[:, h]
        out[:, p0 : p0 + width] = acc[:, :width]
    return out + 0.0  # -0.0 -> +0.0: equal scores must look equal to the ranking


def candidates(pools: int, positions: torch.Tensor, kpool: int) -> torch.Tensor:
    """[n, P] bool: pool p is a candidate for the query at position t iff it ends at or before t."""
    ends = torch.arange(pools, device=positions.device) * kpool + kpool - 1
    return ends[None, :] <= positions[:, None]


def choose_pools(scores: torch.Tensor, candidate: torch.Tensor, limit: int) -> torch.Tensor:
    """The best `limit` candidates of each row by the tie rule: higher score first, then the
    earlier pool. scores [n, P] fp32; candidate [n, P] bool -> [n, P] bool."""
    ranked = scores.masked_fill(~candidate, float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[:, :limit]
    chosen = torch.zeros_like(candidate).scatter_(1, order, True)
    return chosen & candidate


def token_mask(chosen: torch.Tensor, positions: torch.Tensor, end: int, kpool: int) -> torch.Tensor:
    """Expand chosen pools [n, P] to their tokens and add each query's tail: [n, end] bool."""
    n, pools = chosen.shape
    mask = torch.zeros(n, end, dtype=torch.bool, device=chosen.device)
    mask[:, : pools * kpool] = chosen.repeat_interleave(kpool, dim=1)
    keys = torch.arange(end, device=chosen.device)[None, :]
    tail_start = (positions + 1) // kpool * kpool
    return mask | ((keys >= tail_start[:, None]) & (keys <= positions[:, None]))
