"""transformers 5.23.0 `Lfm2MoeForCausalLM` at a dummy model's shape, sharing its weights (no
copy), for the baseline `generate` timings and a token comparison."""

from __future__ import annotations

import time
from typing import Any

import torch

from tensorfold_lfm2_moe.dummy import expert_stacks
from tensorfold_lfm2_moe.model import Lfm2MoeModel
from tensorfold_lfm2_moe.weights import AttentionWeights, DenseWeights


def hf_config(model: Lfm2MoeModel) -> Any:
    from transformers import Lfm2MoeConfig

    c = model.cfg
    return Lfm2MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.moe_intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        layer_types=list(c.layer_types), num_dense_layers=c.num_dense_layers,
        num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
        use_expert_bias=c.use_expert_bias, norm_topk_prob=c.norm_topk_prob,
        routed_scaling_factor=c.routed_scaling_factor, conv_L_cache=c.conv_L_cache,
        conv_bias=c.conv_bias, norm_eps=c.norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )


def state_dict(model: Lfm2MoeModel) -> dict[str, torch.Tensor]:
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
            sd.update({f"{a}.q_proj.weight": m.q, f"{a}.k_proj.weight": m.k,
                       f"{a}.v_proj.weight": m.v, f"{a}.out_proj.weight": m.out,
                       f"{a}.q_layernorm.weight": m.q_norm, f"{a}.k_layernorm.weight": m.k_norm})
        else:
            sd[f"{p}.conv.in_proj.weight"] = m.in_proj
            sd[f"{p}.conv.out_proj.weight"] = m.out_proj
            sd[f"{p}.conv.conv.weight"] = m.conv[:, None, :]
        f = layer.ffn
        if isinstance(f, DenseWeights):
            sd.update({f"{p}.feed_forward.w1.weight": f.w1, f"{p}.feed_forward.w3.weight": f.w3,
                       f"{p}.feed_forward.w2.weight": f.w2})
        else:
            gate_up, down = expert_stacks(f)
            sd[f"{p}.feed_forward.gate.weight"] = f.gate
            sd[f"{p}.feed_forward.experts.gate_up_proj"] = gate_up
            sd[f"{p}.feed_forward.experts.down_proj"] = down
            if f.expert_bias is not None:
                sd[f"{p}.feed_forward.expert_bias"] = f.expert_bias
    return sd


def build_hf(model: Lfm2MoeModel) -> Any:
    """The reference model on model.device, its parameters our tensors."""
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
        prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    )
    sync(device)
    return out[:, prompts.shape[1]:], time.perf_counter() - t0


def decode_rate(hf: Any, prompts: torch.Tensor, short: int, long: int) -> dict[str, float]:
    """Decode tokens/s from two generate lengths (their difference leaves the prefill out)."""
    generate(hf, prompts, 2)  # warm-up
    _, t_short = generate(hf, prompts, short)
    _, t_long = generate(hf, prompts, long)
    b = prompts.shape[0]
    return {
        "streams": b, "tokens_per_s": b * (long - short) / (t_long - t_short),
        "generate_s": t_long, "new_tokens": long,
    }
