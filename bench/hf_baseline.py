"""transformers 5.23.0 at a dummy model's shape, sharing its weights (no copy of the big ones),
for the baseline `generate` timings and a token comparison: `Lfm2MoeForCausalLM` for lfm2_moe,
`Gemma4ForCausalLM` (a `Gemma4TextConfig` built from ours) for gemma4."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tensorfold_gemma4.model import Gemma4Model
    from tensorfold_lfm2_moe.model import Lfm2MoeModel


def hf_config(model: "Lfm2MoeModel") -> Any:
    from transformers import Lfm2MoeConfig

    c = model.cfg
    return Lfm2MoeConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        layer_types=list(c.layer_types),
        num_dense_layers=c.num_dense_layers,
        num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok,
        use_expert_bias=c.use_expert_bias,
        norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor,
        conv_L_cache=c.conv_L_cache,
        conv_bias=c.conv_bias,
        norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=None,
    )


def state_dict(model: "Lfm2MoeModel") -> dict[str, torch.Tensor]:
    from tensorfold_lfm2_moe.dummy import expert_stacks
    from tensorfold_lfm2_moe.weights import AttentionWeights, DenseWeights

    w = model.weights
    sd = {
        "model.embed_tokens.weight": w.embed,
        "model.embedding_norm.weight": w.final_norm,
        "lm_head.weight": w.lm_head,
    }
    for i, layer in enumerate(w.layers):
        p = f"model.layers.{i}"
        sd[f"{p}.operator_norm.weight"] = layer.operator_norm
        sd[f"{p}.ffn_norm.weight"] = layer.ffn_norm
        m = layer.mixer
        if isinstance(m, AttentionWeights):
            a = f"{p}.self_attn"
            sd.update(
                {
                    f"{a}.q_proj.weight": m.q,
                    f"{a}.k_proj.weight": m.k,
                    f"{a}.v_proj.weight": m.v,
                    f"{a}.out_proj.weight": m.out,
                    f"{a}.q_layernorm.weight": m.q_norm,
                    f"{a}.k_layernorm.weight": m.k_norm,
                }
            )
        else:
            sd[f"{p}.conv.in_proj.weight"] = m.in_proj
            sd[f"{p}.conv.out_proj.weight"] = m.out_proj
            sd[f"{p}.conv.conv.weight"] = m.conv[:, None, :]
        f = layer.ffn
        if isinstance(f, DenseWeights):
            sd.update(
                {
                    f"{p}.feed_forward.w1.weight": f.w1,
                    f"{p}.feed_forward.w3.weight": f.w3,
                    f"{p}.feed_forward.w2.weight": f.w2,
                }
            )
        else:
            gate_up, down = expert_stacks(f)
            sd[f"{p}.feed_forward.gate.weight"] = f.gate
            sd[f"{p}.feed_forward.experts.gate_up_proj"] = gate_up
            sd[f"{p}.feed_forward.experts.down_proj"] = down
            if f.expert_bias is not None:
                sd[f"{p}.feed_forward.expert_bias"] = f.expert_bias
    return sd


def build_hf(model: Any) -> Any:
    """The reference model on model.device, its parameters our tensors."""
    if model.name == "gemma4":
        return build_gemma4(model)
    from transformers import Lfm2MoeForCausalLM

    cfg = hf_config(model)
    with torch.device("meta"):
        hf = Lfm2MoeForCausalLM(cfg)
    missing, unexpected = hf.load_state_dict(state_dict(model), strict=False, assign=True)
    assert not unexpected, unexpected
    assert not missing, missing
    hf.model.pos_emb = type(hf.model.pos_emb)(cfg).to(model.device)  # its buffers were on meta
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def gemma4_config(model: "Gemma4Model") -> Any:
    """A Gemma4TextConfig that builds the same layers as our config."""
    from transformers import Gemma4TextConfig

    c = model.cfg
    sliding = [x for x in c.layers if x.window is not None] or list(c.layers)
    full = [x for x in c.layers if x.window is None] or list(c.layers)
    rope = {
        kind: {
            "rope_type": r.rope_type,
            "rope_theta": r.theta,
            **(
                {"partial_rotary_factor": r.partial_rotary_factor}
                if r.rope_type == "proportional"
                else {}
            ),
        }
        for kind, r in c.rope.items()
    }
    reuse = [x for x in c.layers if x.reuses_kv]
    return Gemma4TextConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=sliding[0].kv_heads,
        head_dim=sliding[0].head_dim,
        global_head_dim=full[0].head_dim,
        num_global_key_value_heads=full[0].kv_heads,
        attention_k_eq_v=any(x.k_eq_v for x in c.layers),
        layer_types=list(c.layer_types),
        sliding_window=sliding[0].window or 1,
        rope_parameters=rope,
        rms_norm_eps=c.rms_norm_eps,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=c.final_logit_softcapping,
        enable_moe_block=c.enable_moe_block,
        num_experts=c.num_experts or None,
        top_k_experts=c.top_k_experts or None,
        moe_intermediate_size=c.moe_intermediate_size or None,
        hidden_size_per_layer_input=c.hidden_size_per_layer_input,
        vocab_size_per_layer_input=c.vocab_size_per_layer_input,
        num_kv_shared_layers=len(reuse),
        use_double_wide_mlp=any(x.mlp_size != c.intermediate_size for x in reuse),
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        pad_token_id=c.pad_token_id,
        bos_token_id=2,
        eos_token_id=None,
    )


def gemma4_state_dict(model: "Gemma4Model") -> dict[str, torch.Tensor]:
    """Our weights under Gemma4ForCausalLM's names: the matrices shared, the fp32 norms cast to
    the model dtype (they were read from it, so the values are the same)."""
    w, dt = model.weights, model.dtype

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t.to(dt)

    sd = {"model.embed_tokens.weight": w.embed, "model.norm.weight": norm(w.final_norm)}
    if w.lm_head is not w.embed:
        sd["lm_head.weight"] = w.lm_head
    if w.ple_embed is not None:
        assert w.ple_projection is not None and w.ple_norm is not None
        sd["model.embed_tokens_per_layer.weight"] = w.ple_embed
        sd["model.per_layer_model_projection.weight"] = w.ple_projection
        sd["model.per_layer_projection_norm.weight"] = norm(w.ple_norm)
    for i, layer in enumerate(w.layers):
        p, a = f"model.layers.{i}", layer.attention
        sd.update(
            {
                f"{p}.layer_scalar": layer.layer_scalar,
                f"{p}.input_layernorm.weight": norm(layer.input_norm),
                f"{p}.post_attention_layernorm.weight": norm(layer.post_attention_norm),
                f"{p}.pre_feedforward_layernorm.weight": norm(layer.pre_mlp_norm),
                f"{p}.post_feedforward_layernorm.weight": norm(layer.post_mlp_norm),
                f"{p}.self_attn.q_proj.weight": a.q,
                f"{p}.self_attn.o_proj.weight": a.o,
                f"{p}.self_attn.q_norm.weight": norm(a.q_norm),
                f"{p}.mlp.gate_proj.weight": layer.mlp.gate,
                f"{p}.mlp.up_proj.weight": layer.mlp.up,
                f"{p}.mlp.down_proj.weight": layer.mlp.down,
            }
        )
        if a.k is not None:
            assert a.k_norm is not None
            sd[f"{p}.self_attn.k_proj.weight"] = a.k
            sd[f"{p}.self_attn.k_norm.weight"] = norm(a.k_norm)
        if a.v is not None:
            sd[f"{p}.self_attn.v_proj.weight"] = a.v
        if layer.moe is not None:
            m = layer.moe
            sd.update(
                {
                    f"{p}.router.proj.weight": m.router,
                    f"{p}.router.scale": m.router_scale,
                    f"{p}.router.per_expert_scale": m.per_expert_scale,
                    f"{p}.experts.gate_up_proj": m.gate_up,
                    f"{p}.experts.down_proj": m.down,
                    f"{p}.pre_feedforward_layernorm_2.weight": norm(m.pre_norm),
                    f"{p}.post_feedforward_layernorm_1.weight": norm(m.post_norm_mlp),
                    f"{p}.post_feedforward_layernorm_2.weight": norm(m.post_norm_experts),
                }
            )
        if layer.ple is not None:
            sd.update(
                {
                    f"{p}.per_layer_input_gate.weight": layer.ple.gate,
                    f"{p}.per_layer_projection.weight": layer.ple.projection,
                    f"{p}.post_per_layer_input_norm.weight": norm(layer.ple.post_norm),
                }
            )
    return sd


def build_gemma4(model: "Gemma4Model") -> Any:
    """Gemma4ForCausalLM on model.device in model.dtype, its matrices our tensors."""
    from transformers import Gemma4ForCausalLM

    cfg = gemma4_config(model)
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(cfg)
    sd = gemma4_state_dict(model)
    tied = "lm_head.weight" not in sd
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if tied else set()), missing
    if tied:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    device = model.device
    # non-persistent buffers were made on meta: make them again on the device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(cfg, device=device)
    for module in hf.modules():
        if hasattr(module, "embed_scale") and getattr(module.embed_scale, "is_meta", False):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    assert not left, left
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def generate(hf: Any, prompts: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy generate; returns (new tokens [B, new_tokens], seconds)."""
    device = prompts.device
    sync(device)
    t0 = time.perf_counter()
    out = hf.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
    )
    sync(device)
    return out[:, prompts.shape[1] :], time.perf_counter() - t0


def decode_rate(hf: Any, prompts: torch.Tensor, short: int, long: int) -> dict[str, float]:
    """Decode tokens/s from two generate lengths (their difference leaves the prefill out)."""
    generate(hf, prompts, 2)  # warm-up
    _, t_short = generate(hf, prompts, short)
    _, t_long = generate(hf, prompts, long)
    b = prompts.shape[0]
    return {
        "streams": b,
        "tokens_per_s": b * (long - short) / (t_long - t_short),
        "generate_s": t_long,
        "new_tokens": long,
    }
