"""transformers 5.23.0's Glm5NextForConditionalGeneration on a tensorfold glm5_next model's own
weights (for bench/glm_speed.py): the reference built on the meta device, then every text weight
assigned from ours, sharing storage where the layouts agree (the experts' stacks of a dummy
model, the projections), so both fit beside each other at GLM-5.3-Flash-8L's 76 GB. The vision
tower is one tiny block, materialised empty: text passes never reach it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from tensorfold_glm.config import GlmConfig
from tensorfold_glm.weights import DenseWeights, KdaWeights, ModelWeights, MoeWeights

VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    projection_intermediate_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)

TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_shared_experts",
    "n_routed_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "n_group",
    "topk_group",
    "num_experts_per_tok",
    "norm_topk_prob",
    "max_position_embeddings",
    "rms_norm_eps",
    "attention_bias",
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "index_kpool",
    "index_kpool_always_select_tail",
    "swiglu_limit",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
    "linear_lower_bound",
    "hc_mult",
    "hc_eps",
    "hc_sinkhorn_iters",
    "tie_word_embeddings",
)


def text_config(cfg: GlmConfig) -> dict[str, Any]:
    out = {k: getattr(cfg, k) for k in TEXT_KEYS}
    out.update(
        layer_types=list(cfg.layer_types),
        mlp_layer_types=list(cfg.mlp_layer_types),
        indexer_types=list(cfg.indexer_types),
        pad_token_id=min(154820, cfg.vocab_size - 1),
    )  # the class default, if in range
    return out


def _dense(p: str, w: DenseWeights, out: dict[str, torch.Tensor]) -> None:
    width = w.down.shape[1]
    out[f"{p}.gate_proj.weight"] = w.gate_up[:width]
    out[f"{p}.up_proj.weight"] = w.gate_up[width:]
    out[f"{p}.down_proj.weight"] = w.down


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The experts' stacked tensor: a view when they already lie back to back (a dummy model)."""
    first = tensors[0]
    view = first.as_strided(
        (len(tensors), *first.shape), (first.numel(), *first.stride()), first.storage_offset()
    )
    if (
        all(
            t.data_ptr() == first.data_ptr() + i * first.numel() * first.element_size()
            for i, t in enumerate(tensors)
        )
        and first.is_contiguous()
    ):
        return view
    return torch.stack(tensors)


def state_dict(cfg: GlmConfig, w: ModelWeights, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The reference's state-dict names (not the on-disk ones) for our weights."""
    root = "model.language_model."
    out: dict[str, torch.Tensor] = {
        f"{root}embed_tokens.weight": w.embed,
        f"{root}norm.weight": w.final_norm,
        "lm_head.weight": w.lm_head,
    }
    d = cfg.kda_dim
    for i, layer in enumerate(w.layers):
        p = f"{root}layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer.input_norm
        out[f"{p}.post_attention_layernorm.weight"] = layer.post_norm
        for name, hc in (("attn_hc", layer.attn_hc), ("ffn_hc", layer.ffn_hc)):
            out[f"{p}.{name}.fn"] = hc.fn.to(dtype)  # stored in the model dtype, upcast in the op
            out[f"{p}.{name}.base"] = hc.base
            out[f"{p}.{name}.scale"] = hc.scale
        a, m = f"{p}.self_attn", layer.mixer
        if isinstance(m, KdaWeights):
            for j, x in enumerate("qkv"):
                out[f"{a}.{x}_proj.weight"] = m.qkv[j * d : (j + 1) * d]
            out[f"{a}.conv1d.weight"] = m.conv.view(3 * d, 1, -1)
            out[f"{a}.forget_gate.dt_bias"] = m.dt_bias
            out[f"{a}.forget_gate.A_log"] = m.a_log
            out[f"{a}.forget_gate.f_a_proj.weight"] = m.f_a
            out[f"{a}.forget_gate.f_b_proj.weight"] = m.f_b
            for key, t in (
                ("b_proj", m.b),
                ("g_a_proj", m.g_a),
                ("g_b_proj", m.g_b),
                ("o_proj", m.o),
            ):
                out[f"{a}.{key}.weight"] = t
            out[f"{a}.o_norm.weight"] = m.o_norm
        else:
            heads, r = cfg.num_attention_heads, cfg.kv_lora_rank
            kv_b = torch.cat((m.w_uk.transpose(1, 2), m.w_uv), dim=1).reshape(-1, r)
            weights = {
                "q_a_proj": m.q_a,
                "q_a_layernorm": m.q_a_norm,
                "q_b_proj": m.q_b,
                "kv_a_proj_with_mqa": m.kv_a,
                "kv_a_layernorm": m.kv_a_norm,
                "kv_b_proj": kv_b,
                "o_proj": m.o,
            }
            for key, t in weights.items():
                out[f"{a}.{key}.weight"] = t
            for key, t in (
                ("q_a_proj", m.q_a_bias),
                ("kv_a_proj_with_mqa", m.kv_a_bias),
                ("o_proj", m.o_bias),
            ):
                if t is not None:
                    out[f"{a}.{key}.bias"] = t
            assert kv_b.shape[0] == heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
            ix = m.indexer
            if ix is not None:
                q = f"{a}.indexer"
                out.update(
                    {
                        f"{q}.wq_b.weight": ix.wq_b,
                        f"{q}.wk.weight": ix.wk,
                        f"{q}.k_norm.weight": ix.k_norm,
                        f"{q}.k_norm.bias": ix.k_bias,
                        f"{q}.weights_proj.weight": ix.weights_proj,
                        f"{q}.index_kpool_compress_ape": ix.ape,
                        f"{q}.index_kpool_compress_gate": ix.gate,
                    }
                )
        f, mp = layer.ffn, f"{p}.mlp"
        if isinstance(f, MoeWeights):
            out[f"{mp}.gate.weight"] = f.router.to(dtype)
            out[f"{mp}.gate.e_score_correction_bias"] = f.bias
            out[f"{mp}.experts.gate_up_proj"] = _stack([e.gate_up for e in f.experts])
            out[f"{mp}.experts.down_proj"] = _stack([e.down for e in f.experts])
            _dense(f"{mp}.shared_experts", f.shared, out)
        else:
            _dense(mp, f, out)
    return out


def build_hf(model) -> Any:
    """Glm5NextForConditionalGeneration holding `model`'s weights (eval, same device/dtype)."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    cfg: GlmConfig = model.cfg
    config = Glm5NextConfig(text_config=text_config(cfg), vision_config=VISION)
    config.text_config.dtype = model.dtype
    with torch.device("meta"):
        hf = Glm5NextForConditionalGeneration(config)
    sd = state_dict(cfg, model.weights, model.dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    text_missing = [k for k in missing if not k.startswith("model.visual.")]
    if text_missing or unexpected:
        raise RuntimeError(
            f"weights not mapped: missing {text_missing[:5]}, unexpected {unexpected[:5]}"
        )
    hf.model.visual.to_empty(device=model.device)
    hf.model.visual.to(model.dtype)
    for name, buf in list(hf.named_buffers()):
        if buf.is_meta:
            raise RuntimeError(f"buffer {name} was left on the meta device")
    return hf.eval()


def kda_kernels() -> dict[str, Any]:
    """What transformers' KDA layers can use: fla-core (fla) and the kernels hub (kernels)."""
    return {pkg: importlib.util.find_spec(pkg) is not None for pkg in ("fla", "kernels")}
