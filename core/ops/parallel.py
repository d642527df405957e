"""The collectives a family's forward calls under tensor and expert parallel.

Exactness: partial results are combined by an all_gather, which moves bits and adds nothing,
then summed here in rank order in fp32 (`rank_order_sum`). So a row's sum is the same on every
rank and does not depend on the pass's size or how the message is cut (an all_reduce may change
its summation order with the message size). On CUDA, messages up to a few MiB (decode rounds)
take the one-shot sum over symmetric memory instead (ops/symmetric_reduce.py: the same sum in
one kernel, the same bits, no NCCL launch); larger ones the all_gather. At a given TP size
concurrent == solo, resumed == fresh and pages == windows hold as they do at one rank; between
TP sizes the sums round differently.

With no group (one process) every function is the identity, and torch.distributed is never
imported. `tensorfold.tensor_parallel` sets the group once, at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .gpu import use_triton
from .linear import linear


@dataclass(frozen=True)
class Group:
    """This process's rank of `world`, and the process group the forward's collectives use."""

    rank: int = 0
    world: int = 1
    pg: Any = None
    reduce: Any = None  # a symmetric_reduce.OneShot for small messages on CUDA, or None


_GROUP = Group()


def current() -> Group:
    return _GROUP


def set_group(group: Group | None) -> None:
    global _GROUP
    _GROUP = group or Group()


def _gather(x: torch.Tensor, g: Group) -> torch.Tensor:
    """[world, *x.shape]: every rank's x, in rank order."""
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty(g.world, *x.shape)
    if x.is_cuda:
        dist.all_gather_into_tensor(out, x, group=g.pg)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=g.pg)
    return out


def begin_pass() -> None:
    """Before each forward pass's first collective, on every rank (the runners call it, also
    inside a CUDA graph's capture): the one-shot sum's fence. Nothing without one."""
    if _GROUP.reduce is not None:
        _GROUP.reduce.begin_pass()


def rank_order_sum(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts [world, ...] -> Σ_r float32(parts[r]) in rank order, rounded once to dtype."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    return acc.to(dtype)


def sum_partials(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Σ over ranks of each rank's partial x [..., H] (a row-parallel linear's output, or the
    local experts'), summed in rank order in fp32 and rounded to `dtype` (default: x's)."""
    g = _GROUP
    dtype = dtype or x.dtype
    if g.world == 1:
        return x if dtype == x.dtype else x.to(dtype)
    if g.reduce is not None and g.reduce.takes(x, dtype):
        return g.reduce.sum(x, dtype)
    return rank_order_sum(_gather(x, g), dtype)


def gather_columns(x: torch.Tensor) -> torch.Tensor:
    """Every rank's columns side by side, in rank order: x [..., n] -> [..., world * n] (a
    vocab-parallel lm_head's logits). Moves bits only."""
    g = _GROUP
    if g.world == 1:
        return x
    parts = _gather(x, g)  # [world, ..., n]
    return torch.cat(parts.unbind(0), dim=-1)


def row_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """A row-parallel linear: x [..., K/world] @ weight[N, K/world]ᵀ, summed over ranks, then the
    (replicated) bias added once. At one rank: exactly `linear(x, weight, bias)`."""
    if _GROUP.world == 1:
        return linear(x, weight, bias)
    out = sum_partials(linear(x, weight))
    return out if bias is None else out + bias


def local_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    first: int,
    **ffn: Any,
) -> torch.Tensor:
    """This rank's share of a routed MoE: Σ over the row's slots whose expert is local (experts
    first .. first + len(w1) - 1, whose weights w1[e - first]...) of weight · expert(x), in slot
    order, in fp32 [N, H]. x [N, H]; weights, experts [N, k] (the replicated router's). `ffn`:
    ops.moe.moe's keywords (act, limit, fp32_slots), as at one rank."""
    count = len(w1)
    local = experts - first
    mine = (local >= 0) & (local < count)
    if use_triton(x):
        # The grouped kernels on every slot, another rank's slots sent to expert 0 with weight 0
        # (no host sync). They cost compute, not weight reads, beside the local ones.
        from .moe import moe

        ids = torch.where(mine, local, torch.zeros_like(local))
        masked = torch.where(mine, weights, torch.zeros_like(weights))
        summed = moe(x, masked, ids, w1, w3, w2, **ffn)
        assert isinstance(summed, torch.Tensor)  # sum_slots: the slots summed
        return summed.float()
    from .moe import weighted_slots
    from .slot_sum import fp32_sum

    dtype = torch.float32 if ffn.pop("fp32_slots", False) else x.dtype
    ids = torch.where(mine, local, torch.full_like(local, count))
    return fp32_sum(weighted_slots(x, weights, ids, w1, w3, w2, dtype, **ffn))


def expert_parallel_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
    first: int,
    **ffn: Any,
) -> torch.Tensor:
    """The routed MoE with the experts spread over the ranks: each rank runs its own (see
    local_moe) and the fp32 partials are summed in rank order. Returns [N, H] in x's dtype."""
    return sum_partials(local_moe(x, weights, experts, w1, w3, w2, first, **ffn), x.dtype)
