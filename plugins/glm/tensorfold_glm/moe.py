"""The feed-forward blocks (modeling_glm5_next.py 85-206): the clamped SwiGLU and the MoE.

SwiGLU: down(silu(min(gate x, L)) · clamp(up x, -L, L)), L = swiglu_limit (no lower clamp on
the gate). MoE router, in fp32: s = sigmoid(W x); experts are chosen on s + correction bias,
within the topk_group best groups (a group scores the sum of its two best biased scores);
weights are the unbiased s, renormalised (+1e-20) and times routed_scaling_factor. Each token's
expert outputs are rounded to the model dtype and summed in expert order, then the shared expert
is added, as the reference's index_add_ does.

Ranking ties (experts or groups with equal scores) go to the lower index.

On the GPU (`tensorfold.ops.gpu.use_triton`) `swiglu` and `moe` run the Triton kernels of
triton_ffn.py, which round and sum as this code does.

Under tensor and expert parallel (shards.py) a dense FFN's (and the shared expert's) gate/up hold
this rank's rows and down its columns, and the routed experts are this rank's
(`MoeWeights.first_expert` on). The router runs whole on every rank; each rank's routed experts
(`tensorfold.ops.parallel.local_moe`, fp32) and its part of the shared expert are added in fp32
and the ranks' partials summed once (`sum_partials`): one collective per FFN. At one rank none of
this runs and the bits are the reference's.
"""

from __future__ import annotations

import torch

from tensorfold.ops import parallel
from tensorfold.ops.fp8 import kernels_take
from tensorfold.ops.gpu import use_triton
from tensorfold.ops.linear import linear

from .config import GlmConfig
from .ops import sigmoid, silu
from .weights import DenseWeights, MoeWeights


def swiglu(x: torch.Tensor, w: DenseWeights, limit: float) -> torch.Tensor:
    """x [n, H] -> [n, H]. fp8 weights: linear_fp8's products (on the GPU the fp8 form of the
    same kernels, triton_ffn)."""
    if use_triton(x) and kernels_take(w.gate_up, w.down):
        from .triton_ffn import swiglu as triton_swiglu

        return triton_swiglu(x, w, limit)
    gate, up = linear(x, w.gate_up).chunk(2, dim=-1)
    return linear(silu(gate.clamp(max=limit)) * up.clamp(-limit, limit), w.down)


def kernels_take_layer(w: MoeWeights) -> bool:
    """Whether the GPU's kernels take the layer's experts and shared expert as stored (plain,
    or fp8 of blocks they read: tensorfold.ops.fp8.kernels_take); else the torch path."""
    routed = [w.experts[0].gate_up, w.experts[0].down] if w.experts else []
    return kernels_take(w.shared.gate_up, w.shared.down, *routed)


def _ranked(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best entries along the last dim, higher first, ties to the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (weights [N, k] fp32, experts [N, k] long)."""
    n, experts = x.shape[0], cfg.n_routed_experts
    scores = sigmoid(linear(x.float(), w.router))  # [N, E] fp32
    choice = scores + w.bias
    if cfg.n_group > 1:
        groups = choice.view(n, cfg.n_group, experts // cfg.n_group)
        best = torch.sort(groups, dim=-1, descending=True).values
        group_scores = best[..., 0] + best[..., 1]  # [N, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, _ranked(group_scores, cfg.topk_group), True)
        keep = keep[:, :, None].expand_as(groups).reshape(n, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    chosen = _ranked(choice, cfg.num_experts_per_tok)
    weights = scores.gather(1, chosen)
    if cfg.norm_topk_prob:
        total = weights[:, 0]
        for j in range(1, weights.shape[1]):
            total = total + weights[:, j]
        weights = weights / (total[:, None] + 1e-20)
    return weights * cfg.routed_scaling_factor, chosen


def moe(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """x [N, H] -> [N, H]: the routed experts (each on its own rows, so a row's result does not
    depend on which rows share its experts) plus the shared expert."""
    if parallel.current().world > 1:
        return parallel.sum_partials(moe_partial(cfg, x, w), x.dtype)
    if use_triton(x) and kernels_take_layer(w):
        from .triton_ffn import moe as triton_moe

        return triton_moe(cfg, x, w)
    n, k = x.shape[0], cfg.num_experts_per_tok
    weights, chosen = route(cfg, x, w)
    # Each row's slots in expert order, the order the reference accumulates them in.
    order = torch.argsort(chosen, dim=1, stable=True)
    chosen, weights = chosen.gather(1, order), weights.gather(1, order)
    flat = chosen.reshape(-1)  # entry r*k + j: row r's j-th expert
    slots = x.new_empty(n * k, x.shape[1])
    by_expert = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=cfg.n_routed_experts).tolist()
    start = 0
    for e, count in enumerate(counts):
        if not count:
            continue
        picks = by_expert[start : start + count]
        start += count
        y = swiglu(x.index_select(0, picks // k), w.experts[e], cfg.swiglu_limit)
        slots[picks] = (y * weights.reshape(-1)[picks, None]).to(x.dtype)
    per_row = slots.view(n, k, -1)
    out = per_row[:, 0]
    for j in range(1, k):
        out = out + per_row[:, j]
    return out + swiglu(x, w.shared, cfg.swiglu_limit)


def moe_partial(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """This rank's share of the MoE, fp32 [N, H]: its routed experts' slots (each rounded to
    x's dtype, summed in expert order in fp32) plus its part of the shared expert."""
    if use_triton(x) and kernels_take_layer(w):
        from .triton_ffn import moe_partial as triton_partial

        return triton_partial(cfg, x, w)
    weights, chosen = route(cfg, x, w)
    order = torch.argsort(chosen, dim=1, stable=True)  # each row's slots in expert order
    chosen, weights = chosen.gather(1, order), weights.gather(1, order)
    w1 = [e.gate_up[: e.down.shape[1]] for e in w.experts]  # gate rows, then up rows
    w3 = [e.gate_up[e.down.shape[1] :] for e in w.experts]
    routed = parallel.local_moe(
        x,
        weights,
        chosen,
        w1,
        w3,
        [e.down for e in w.experts],
        w.first_expert,
        act="silu_clamp",
        limit=cfg.swiglu_limit,
    )
    return routed + swiglu(x, w.shared, cfg.swiglu_limit).float()


def ffn(cfg: GlmConfig, x: torch.Tensor, w: DenseWeights | MoeWeights) -> torch.Tensor:
    """x [N, H] -> [N, H]; under tensor parallel the ranks' partials summed (one collective)."""
    if isinstance(w, DenseWeights):
        return parallel.sum_partials(swiglu(x, w, cfg.swiglu_limit))
    return moe(cfg, x, w)
