"""Bytes a decode step must read, and active parameters: the limits of docs/performance.md.
A weight is a tensor or an fp8 weight (--quantization fp8: its e4m3 values and their scales)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from tensorfold.ops.fp8 import Fp8Weight


def is_weight(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, Fp8Weight))


def nbytes(t: torch.Tensor | Fp8Weight) -> int:
    """Bytes a weight holds (an fp8 weight's values and scales)."""
    return t.nbytes if isinstance(t, Fp8Weight) else t.numel() * t.element_size()


def numel(t: torch.Tensor | Fp8Weight) -> int:
    """Parameters a weight holds (an fp8 weight's values, not its scales)."""
    return t.numel()


def address(t: torch.Tensor | Fp8Weight) -> int:
    """Where a weight's values start: one key a storage view."""
    return t.q.data_ptr() if isinstance(t, Fp8Weight) else t.data_ptr()


def step_bytes(model, count: Callable[[Any], int] = nbytes) -> dict[str, int]:
    """Weight bytes a decode step must read: everything but the embedding table (one row) and
    the unused experts; with one stream, top-k experts a MoE layer; with all, every expert.
    count=numel: parameters instead of bytes."""
    if model.name == "gemma4":
        return _gemma4_step_bytes(model, count)
    from tensorfold_lfm2_moe.weights import AttentionWeights, DenseWeights

    cfg, w = model.cfg, model.weights
    common = count(w.lm_head)
    expert = 0
    moe_layers = 0
    for layer in w.layers:
        m, f = layer.mixer, layer.ffn
        tensors = [layer.operator_norm, layer.ffn_norm]
        if isinstance(m, AttentionWeights):
            tensors += [m.q, m.k, m.v, m.out, m.q_norm, m.k_norm]
        else:
            tensors += [m.in_proj, m.conv, m.out_proj]
        if isinstance(f, DenseWeights):
            tensors += [f.w1, f.w3, f.w2]
        else:
            tensors += [f.gate]
            moe_layers += 1
            expert = sum(_per_expert(x, count) for x in (f.w1, f.w3, f.w2))
        common += sum(count(t) for t in tensors)
    total = sum(count(t) for t in _all_tensors(w))
    return experts_read(common, expert, moe_layers, cfg.num_experts, cfg.num_experts_per_tok, total)


def experts_read(
    common: int, expert: int, moe_layers: int, e: int, k: int, weights_total: int
) -> dict[str, Any]:
    """A decode step's weight bytes: `common` bytes and the experts (`expert` bytes each, top k
    of e in each of `moe_layers` layers) its rows hit: k with one stream, all e at most (no
    experts: `common` alone)."""
    return {
        "one_stream": common + moe_layers * k * expert,
        "all_experts": common + moe_layers * e * expert,
        # experts n rows hit on average when routing is uniform: E(1 - (1 - k/E)^n)
        "expected_bytes": {
            str(n): int(common + moe_layers * e * (1 - (1 - k / e) ** n) * expert) if e else common
            for n in (1, 8, 64)
        },
        "weights_total": weights_total,
    }


def _per_expert(stack: Any, count: Callable[[Any], int]) -> int:
    """One expert's share of a stack [E, ...] (or the first of a sequence of experts)."""
    return count(stack) // len(stack) if is_weight(stack) else count(stack[0])


def _all_tensors(w):
    seen: dict[int, Any] = {}
    for t in [w.embed, w.final_norm, w.lm_head]:
        seen[address(t)] = t
    for layer in w.layers:
        for obj in (layer, layer.mixer, layer.ffn):
            for name, v in vars(obj).items():
                if name == "qkv":  # attention's q, k and v are its rows
                    continue
                for t in v if isinstance(v, list) else [v]:
                    if is_weight(t):
                        seen[address(t)] = t
    return seen.values()


def _tensors(obj) -> dict[int, Any]:
    """Every distinct weight a weights dataclass holds, by storage address."""
    found: dict[int, Any] = {}
    if is_weight(obj):
        found[address(obj)] = obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            found.update(_tensors(x))
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            if name != "qkv":  # attention's q, k and v are its rows
                found.update(_tensors(getattr(obj, name)))
    return found


def _gemma4_step_bytes(model, count: Callable[[Any], int]) -> dict[str, int]:
    """gemma4: every weight but the embedding table (tied: it is the lm_head, read whole) and the
    experts; plus top-k experts (one stream) or all of them a layer. Norm weights are fp32."""
    cfg, w = model.cfg, model.weights

    def total(ws) -> int:
        return sum(count(t) for t in ws)

    experts, expert, common = 0, 0, total([w.lm_head, w.final_norm])
    if w.ple_projection is not None:
        common += total([w.ple_projection, w.ple_norm])
    for layer in w.layers:
        moe = layer.moe
        held = _tensors(layer)
        if moe is not None:
            held.pop(address(moe.gate_up))
            held.pop(address(moe.down))
            expert = _per_expert(moe.gate_up, count) + _per_expert(moe.down, count)
            experts += 1
        common += total(held.values())
    e, k = cfg.num_experts, cfg.top_k_experts
    return experts_read(common, expert, experts, e, k, total(_tensors(w).values()))


def kv_bytes(model, context: int) -> int:
    """Cache bytes one stream's decode step reads at `context` rows: every paged row of every
    paged layer, and the fixed state; a gemma4 sliding ring (`.sk`/`.sv`, [W-1, heads, D]) holds
    min(context, W-1) rows."""
    layout = model.layout
    total = 0
    for spec in layout.paged:
        total += context * math.prod(spec.shape) * torch.empty(0, dtype=_dtype(spec)).element_size()
    for spec in layout.fixed:
        size = torch.empty(0, dtype=_dtype(spec)).element_size()
        rows = math.prod(spec.shape)
        if spec.name.endswith((".sk", ".sv")):
            rows = min(context, spec.shape[0]) * math.prod(spec.shape[1:])
        total += rows * size
    return total


def _dtype(spec) -> torch.dtype:
    return getattr(torch, str(spec.dtype).removeprefix("torch."))


def active_params(model) -> int:
    return step_bytes(model, numel)["one_stream"] + model.cfg.hidden_size  # + the embedding row
