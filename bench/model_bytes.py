"""Bytes a decode step must read, and active parameters: the limits of docs/perf.md."""

from __future__ import annotations

import torch

from tensorfold_lfm2_moe.weights import AttentionWeights, DenseWeights


def step_bytes(model) -> dict[str, int]:
    """Weight bytes a decode step must read: everything but the embedding table (one row) and
    the unused experts; with one stream, top-k experts a MoE layer; with all, every expert."""
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
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return {
        "one_stream": common + moe_layers * k * expert,
        "all_experts": common + moe_layers * e * expert,
        # experts n rows hit on average when routing is uniform: E(1 - (1 - k/E)^n)
        "expected_bytes": {
            str(n): int(common + moe_layers * e * (1 - (1 - k / e) ** n) * expert)
            for n in (1, 8, 64)
        },
        "weights_total": sum(t.numel() * el for t in _all_tensors(w)),
    }


def _all_tensors(w):
    seen: dict[int, torch.Tensor] = {}
    for t in [w.embed, w.final_norm, w.lm_head]:
        seen[t.data_ptr()] = t
    for layer in w.layers:
        for obj in (layer, layer.mixer, layer.ffn):
            for v in vars(obj).values():
                for t in v if isinstance(v, list) else [v]:
                    if isinstance(t, torch.Tensor):
                        seen[t.data_ptr()] = t
    return seen.values()


def active_params(model) -> int:
    cfg = model.cfg
    b = step_bytes(model)["one_stream"] // (torch.finfo(model.dtype).bits // 8)
    return b + cfg.hidden_size  # + the embedding row
