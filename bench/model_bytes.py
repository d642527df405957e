"""Bytes a decode step must read, and active parameters: the limits of docs/performance.md."""

from __future__ import annotations

import math
from typing import Any

import torch


def step_bytes(model) -> dict[str, int]:
    """Weight bytes a decode step must read: everything but the embedding table (one row) and
    the unused experts; with one stream, top-k experts a MoE layer; with all, every expert."""
    if model.name == "gemma4":
        return _gemma4_step_bytes(model)
    from tensorfold_lfm2_moe.weights import AttentionWeights, DenseWeights

    el = torch.finfo(model.dtype).bits // 8
    cfg, w = model.cfg, model.weights
    common = w.lm_head.numel() * el
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * el
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
        common += sum(t.numel() for t in tensors) * el
    total = sum(t.numel() * el for t in _all_tensors(w))
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


def _all_tensors(w):
    seen: dict[int, torch.Tensor] = {}
    for t in [w.embed, w.final_norm, w.lm_head]:
        seen[t.data_ptr()] = t
    for layer in w.layers:
        for obj in (layer, layer.mixer, layer.ffn):
            for name, v in vars(obj).items():
                if name == "qkv":  # attention's q, k and v are its rows
                    continue
                for t in v if isinstance(v, list) else [v]:
                    if isinstance(t, torch.Tensor):
                        seen[t.data_ptr()] = t
    return seen.values()


def _tensors(obj) -> dict[int, torch.Tensor]:
    """Every distinct tensor a weights dataclass holds, by storage address."""
    found: dict[int, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[obj.data_ptr()] = obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            found.update(_tensors(x))
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            if name != "qkv":  # attention's q, k and v are its rows
                found.update(_tensors(getattr(obj, name)))
    return found


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _gemma4_step_bytes(model) -> dict[str, int]:
    """gemma4: every weight but the embedding table (tied: it is the lm_head, read whole) and the
    experts; plus top-k experts (one stream) or all of them a layer. Norm weights are fp32."""
    cfg, w = model.cfg, model.weights
    el = torch.finfo(model.dtype).bits // 8
    experts, common = 0, _bytes([w.lm_head, w.final_norm])
    if w.ple_projection is not None:
        common += _bytes([w.ple_projection, w.ple_norm])
    for layer in w.layers:
        moe = layer.moe
        held = _tensors(layer)
        if moe is not None:
            held.pop(moe.gate_up.data_ptr())
            held.pop(moe.down.data_ptr())
            experts += 1
        common += _bytes(held.values())
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * el
    e, k = cfg.num_experts, cfg.top_k_experts
    return experts_read(common, expert, experts, e, k, _bytes(_tensors(w).values()))


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
    cfg = model.cfg
    b = step_bytes(model)["one_stream"] // (torch.finfo(model.dtype).bits // 8)
    return b + cfg.hidden_size  # + the embedding row
