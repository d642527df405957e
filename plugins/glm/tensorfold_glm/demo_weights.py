"""The demo checkpoint's tensors under their on-disk names, drawn in a fixed order from a local
generator (the global RNG is untouched). Parameters the reference initialises to zeros or ones
(A_log, the mHC base/scale, the pool gate and ape, the score bias, norms) are perturbed so that
they matter. An MTP layer (config num_nextn_predict_layers >= 1) is drawn last, from its own
generator, so the trunk's tensors are the same with or without it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

SEED = 20260101
Tensors = dict[str, "torch.Tensor"]


def build_weights(cfg: dict[str, Any]) -> Tensors:
    import torch

    gen = torch.Generator().manual_seed(SEED)

    def normal(*shape: int, std: float = 0.1, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean

    t = cfg["text_config"]
    h = t["hidden_size"]
    layers = t["num_hidden_layers"]
    w: Tensors = {"model.language_model.embed_tokens.weight": normal(t["vocab_size"], h, std=0.5)}
    for i in range(layers):
        w.update(
            _layer(
                normal,
                f"model.language_model.layers.{i}",
                t,
                t["layer_types"][i],
                t["mlp_layer_types"][i],
                t["indexer_types"][i] == "full",
            )
        )
    w["model.language_model.norm.weight"] = normal(h, mean=1.0)
    w["lm_head.weight"] = normal(t["vocab_size"], h)
    w.update(_vision(normal, "model.visual", cfg["vision_config"]))
    if t.get("num_nextn_predict_layers", 0) > 0:
        mtp = torch.Generator().manual_seed(SEED + 1)
        w.update(
            _mtp(lambda *a, **k: _draw(mtp, *a, **k), f"model.language_model.layers.{layers}", t)
        )
    return w


def _draw(
    gen: "torch.Generator", *shape: int, std: float = 0.1, mean: float = 0.0
) -> "torch.Tensor":
    import torch

    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _layer(
    normal: "Normal", p: str, t: dict[str, Any], kind: str, ffn: str, indexer: bool
) -> Tensors:
    h = t["hidden_size"]
    w = {
        f"{p}.input_layernorm.weight": normal(h, mean=1.0),
        f"{p}.post_attention_layernorm.weight": normal(h, mean=1.0),
    }
    for hc in ("hc_attn", "hc_ffn"):
        w.update(_hc(normal, p, hc, t))
    if kind == "linear_attention":
        w.update(_kda(normal, f"{p}.self_attn", t))
    else:
        w.update(_mla(normal, f"{p}.self_attn", t, indexer))
    if ffn == "dense":
        w.update(_mlp(normal, f"{p}.mlp", h, t["intermediate_size"]))
    else:
        w.update(_moe(normal, f"{p}.mlp", t))
    return w


def _mtp(normal: "Normal", p: str, t: dict[str, Any]) -> Tensors:
    """The MTP layer: its decoder layer (the lists' extra entry, else MLA with its own indexer
    and MoE), enorm, hnorm, eh_proj and shared_head (no embed_tokens of its own)."""
    h, n = t["hidden_size"], t["num_hidden_layers"]
    kinds, ffns = t["layer_types"], t["mlp_layer_types"]
    kind = kinds[n] if len(kinds) > n else "indexed_attention"
    ffn = ffns[n] if len(ffns) > n else "sparse"
    w = {
        f"{p}.enorm.weight": normal(h, mean=1.0),
        f"{p}.hnorm.weight": normal(h, mean=1.0),
        f"{p}.eh_proj.weight": normal(h, 2 * h),
    }
    w.update(_layer(normal, p, t, kind, ffn, True))
    w[f"{p}.shared_head.norm.weight"] = normal(h, mean=1.0)
    w[f"{p}.shared_head.head.weight"] = normal(t["vocab_size"], h)
    return w


Normal = Callable[..., "torch.Tensor"]


def _hc(normal: Normal, p: str, hc: str, t: dict[str, Any]) -> Tensors:
    n, h = t["hc_mult"], t["hidden_size"]
    width = (2 + n) * n
    return {
        f"{p}.{hc}_fn": normal(width, n * h, std=0.05),
        f"{p}.{hc}_base": normal(width, std=0.5),
        f"{p}.{hc}_scale": normal(3, std=0.2, mean=1.0),
    }


def _mlp(normal: Normal, p: str, h: int, width: int) -> Tensors:
    return {
        f"{p}.gate_proj.weight": normal(width, h),
        f"{p}.up_proj.weight": normal(width, h),
        f"{p}.down_proj.weight": normal(h, width),
    }


def _kda(normal: Normal, a: str, t: dict[str, Any]) -> Tensors:
    h, dk, heads = t["hidden_size"], t["linear_head_dim"], t["linear_num_heads"]
    d = dk * heads
    w = {f"{a}.{x}_proj.weight": normal(d, h) for x in "qkv"}
    w.update(
        {
            f"{a}.{x}_conv1d.weight": normal(d, 1, t["linear_conv_kernel_dim"], std=0.5)
            for x in "qkv"
        }
    )
    w.update(
        {
            f"{a}.f_a_proj.weight": normal(dk, h),
            f"{a}.f_b_proj.weight": normal(d, dk),
            f"{a}.dt_bias": normal(d, std=0.5, mean=-2.0),
            f"{a}.A_log": normal(heads, std=0.5),
            f"{a}.b_proj.weight": normal(heads, h),
            f"{a}.g_a_proj.weight": normal(dk, h),
            f"{a}.g_b_proj.weight": normal(d, dk),
            f"{a}.o_norm.weight": normal(dk, mean=1.0),
            f"{a}.o_proj.weight": normal(h, d),
        }
    )
    return w


def _mla(normal: Normal, a: str, t: dict[str, Any], indexer: bool) -> Tensors:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    qr, r = t["q_lora_rank"], t["kv_lora_rank"]
    dn, dv = t["qk_nope_head_dim"], t["v_head_dim"]
    w = {
        f"{a}.q_a_proj.weight": normal(qr, h),
        f"{a}.q_a_layernorm.weight": normal(qr, mean=1.0),
        f"{a}.q_b_proj.weight": normal(heads * dn, qr, std=0.2),
        f"{a}.kv_a_proj_with_mqa.weight": normal(r, h),
        f"{a}.kv_a_layernorm.weight": normal(r, mean=1.0),
        f"{a}.kv_b_proj.weight": normal(heads * (dn + dv), r, std=0.2),
        f"{a}.o_proj.weight": normal(h, heads * dv),
    }
    if indexer:
        n, d, i = t["index_n_heads"], t["index_head_dim"], f"{a}.indexer"
        w.update(
            {
                f"{i}.wq_b.weight": normal(n * d, qr, std=0.2),
                f"{i}.wk.weight": normal(d, h),
                f"{i}.k_norm.weight": normal(d, mean=1.0),
                f"{i}.k_norm.bias": normal(d),
                f"{i}.weights_proj.weight": normal(n, h),
                f"{i}.index_kpool_compress_ape": normal(t["index_kpool"], d, std=0.5),
                f"{i}.index_kpool_compress_gate": normal(d, h, std=0.05),
            }
        )
    return w


def _moe(normal: Normal, m: str, t: dict[str, Any]) -> Tensors:
    h, e, width = t["hidden_size"], t["n_routed_experts"], t["moe_intermediate_size"]
    w = {
        f"{m}.gate.weight": normal(e, h, std=0.3),
        f"{m}.gate.e_score_correction_bias": normal(e, std=0.1),
    }
    for j in range(e):
        w.update(_mlp(normal, f"{m}.experts.{j}", h, width))
    w.update(_mlp(normal, f"{m}.shared_experts", h, width * t["n_shared_experts"]))
    return w


def _vision(normal: Normal, v: str, c: dict[str, Any]) -> Tensors:
    """The vision tower (random: the demo's text model was never trained to read its rows)."""
    d, inner, out = c["hidden_size"], c["intermediate_size"], c["out_hidden_size"]
    merge, patch, temporal = c["spatial_merge_size"], c["patch_size"], c["temporal_patch_size"]
    head = d // c["num_heads"]
    w = {
        f"{v}.patch_embed.proj.weight": normal(d, c["in_channels"], temporal, patch, patch),
        f"{v}.patch_embed.proj.bias": normal(d),
    }
    for b in range(c["depth"]):
        p = f"{v}.blocks.{b}"
        w.update(
            {
                f"{p}.norm1.weight": normal(d, mean=1.0),
                f"{p}.norm2.weight": normal(d, mean=1.0),
                f"{p}.attn.qkv.weight": normal(3 * d, d),
                f"{p}.attn.qkv.bias": normal(3 * d),
                f"{p}.attn.q_norm.weight": normal(head, mean=1.0),
                f"{p}.attn.k_norm.weight": normal(head, mean=1.0),
                f"{p}.attn.proj.weight": normal(d, d),
                f"{p}.attn.proj.bias": normal(d),
            }
        )
        for name, shape in (
            ("gate_proj", (inner, d)),
            ("up_proj", (inner, d)),
            ("down_proj", (d, inner)),
        ):
            w[f"{p}.mlp.{name}.weight"] = normal(*shape)
            w[f"{p}.mlp.{name}.bias"] = normal(shape[0])
    w.update(
        {
            f"{v}.post_layernorm.weight": normal(d, mean=1.0),
            f"{v}.downsample.weight": normal(out, d, merge, merge),
            f"{v}.downsample.bias": normal(out),
            f"{v}.merger.proj.weight": normal(out, out),
            f"{v}.merger.post_projection_norm.weight": normal(out, mean=1.0),
            f"{v}.merger.post_projection_norm.bias": normal(out),
        }
    )
    proj = c["projection_intermediate_size"]
    for name, shape in (
        ("gate_proj", (proj, out)),
        ("up_proj", (proj, out)),
        ("down_proj", (out, proj)),
    ):
        w[f"{v}.merger.{name}.weight"] = normal(*shape)
    return w
