"""glm5_next's feed-forward blocks on the GPU (moe.py's torch code is the reference).

The clamped SwiGLU (dense layers, the shared expert, the routed experts) runs through the gated
FFN kernels of tensorfold.ops.triton_moe with act "silu_clamp", the gate and up halves of each
fused gate_up read as strided views; fp8 weights through the fp8 form of the same kernels
(tensorfold.ops.triton_fp8: ffn_kernel, moe_kernel, the halves cut once by gate_and_up). The router runs in fp32 in tensorfold.ops.triton_route
(x read as fp32, the product in fixed splits of H: no cuBLAS, whose kernel depends on the row
count), and gives each row's slots in expert order, the order the reference sums them in: each
add rounded to the model dtype, then the shared expert. Nothing reads a device value on the host,
so a decode round is captured in its CUDA graph.

Under expert parallel `moe_partial` gives a rank's share (its experts, its part of the shared
expert); moe.py sums the ranks' shares.
"""

from __future__ import annotations

import torch

from tensorfold.ops import triton_fp8, triton_route
from tensorfold.ops.fp8 import Fp8Weight

from .config import GlmConfig
from .weights import DenseWeights, MoeWeights, Weight


def swiglu(x: torch.Tensor, w: DenseWeights, limit: float) -> torch.Tensor:
    """x [n, H] -> [n, H]: down(silu(min(gate x, L)) · clamp(up x, -L, L))."""
    gate, up = triton_fp8.gate_and_up(w.gate_up, w.down.shape[1])
    return triton_fp8.ffn_kernel(x, gate, up, w.down, act="silu_clamp", limit=limit)


def route(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (weights [N, k] fp32, experts [N, k] long), each row's slots in ascending
    expert order."""
    return triton_route.route(
        x,
        w.router,
        w.bias,
        cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob,
        scaling=cfg.routed_scaling_factor,
        fp32=True,
        norm_eps=1e-20,
        groups=cfg.n_group,
        keep_groups=cfg.topk_group,
        by_expert=True,
    )


def moe(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """x [N, H] -> [N, H]: the routed experts plus the shared expert."""
    weights, chosen = route(cfg, x, w)
    gate_up, down = experts_stacked(w)
    gate, up = triton_fp8.gate_and_up(gate_up, down.shape[2])
    shared = swiglu(x, w.shared, cfg.swiglu_limit)
    return triton_fp8.moe_kernel(
        x,
        weights,
        chosen,
        gate,
        up,
        down,
        act="silu_clamp",
        limit=cfg.swiglu_limit,
        round_sum=True,
        plus=shared,
    )


def moe_partial(cfg: GlmConfig, x: torch.Tensor, w: MoeWeights) -> torch.Tensor:
    """Under expert parallel, this rank's share of the MoE in fp32 [N, H]: its routed experts
    (tensorfold.ops.parallel.local_moe: every slot through the grouped kernels, another rank's
    with weight 0, no host sync) plus its part of the shared expert."""
    from tensorfold.ops import parallel

    weights, chosen = route(cfg, x, w)
    gate_up, down = experts_stacked(w)
    gate, up = triton_fp8.gate_and_up(gate_up, down.shape[2])
    routed = parallel.local_moe(
        x,
        weights,
        chosen,
        gate,
        up,
        down,
        w.first_expert,
        act="silu_clamp",
        limit=cfg.swiglu_limit,
    )
    return routed + swiglu(x, w.shared, cfg.swiglu_limit).float()


def experts_stacked(w: MoeWeights) -> tuple[Weight, Weight]:
    """The layer's expert stacks, gate_up [E, 2I, H] and down [E, H, I], kept on the weights
    (plain or fp8: an fp8 stack's codes and scales stacked apart).

    Views when the experts already are evenly spaced views of one storage (the loader and the
    dummy loader make them so). Otherwise the experts are copied into one stack once and each
    expert's weights are re-pointed at their slice of it (the same values), so the separate
    copies are freed and the experts are not held twice."""
    if w.stacks is None:
        gate_up = triton_fp8.stack([e.gate_up for e in w.experts])
        down = triton_fp8.stack([e.down for e in w.experts])
        for j, e in enumerate(w.experts):
            if _address(e.gate_up) != _address(gate_up[j]):
                e.gate_up = gate_up[j]
            if _address(e.down) != _address(down[j]):
                e.down = down[j]
        w.stacks = gate_up, down
    return w.stacks


def _address(w: Weight) -> tuple[int, ...]:
    """Where a weight's values (and an fp8 weight's scales) start."""
    if isinstance(w, Fp8Weight):
        return (w.q.data_ptr(), w.scale.data_ptr())
    return (w.data_ptr(),)
