"""The text weights of a Gemma 4 checkpoint under their on-disk names, shape-checked as they load.

`Gemma4ForConditionalGeneration` checkpoints keep the text model under `model.language_model.`
(beside `model.vision_tower.*` and `model.embed_vision.*`, which vision_weights.py reads, and
`model.audio_tower.*` and `model.embed_audio.*`, which are not read);
`Gemma4ForCausalLM` ones under `model.`. Experts are stored fused (`experts.gate_up_proj`
[E, 2I, H] with the gate rows first, `experts.down_proj` [E, H, I]). Reuse (KV-shared) layers have
no k/v projections or norms (ignored if present, as the reference does). No `lm_head.weight` when
the embeddings are tied. Norm weights are kept in fp32, as the reference upcasts them (from the
model dtype) before scaling.

Under tensor parallel the checkpoint hands each tensor's slice for this rank (shards.py says how
each is cut; the shapes below are the whole tensors on disk, the comments' widths one rank's):
its heads, its MLP channels, its experts of the stacks (gate_up [E/world, 2I, H]), and its
vocabulary of a vocab-parallel lm_head (a view of the tied embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tensorfold.family.checkpoint import CheckpointError, TensorReader
from tensorfold.ops.fp8 import Fp8Weight, cat_rows

from . import shards
from .config import Gemma4Config, Layer

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

TEXT_PREFIXES = ("model.language_model.", "model.")


@dataclass
class AttentionWeights:
    """On a layer with its own K, q, k (and v) are made row slices of one tensor, qkv, at
    construction (every path that builds these weights, a rank's shards too): one product
    computes them all, in no more memory."""

    q: torch.Tensor | Fp8Weight  # [heads*D, H]
    k: torch.Tensor | Fp8Weight | None  # [kv_heads*D, H]; None on reuse layers
    v: torch.Tensor | Fp8Weight | None  # [kv_heads*D, H]; None on reuse and k_eq_v layers
    o: torch.Tensor | Fp8Weight  # [H, heads*D]
    q_norm: torch.Tensor  # [D] fp32
    k_norm: torch.Tensor | None  # [D] fp32; None on reuse layers
    # [(heads + 2·kv_heads)*D, H]
    qkv: torch.Tensor | Fp8Weight | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts = [t for t in (self.q, self.k, self.v) if t is not None]
        self.qkv = cat_rows(parts) if len(parts) > 1 else None
        if self.qkv is not None:
            views = iter(self.qkv.split([len(t) for t in parts]))
            self.q = next(views)
            self.k = next(views)
            self.v = next(views) if self.v is not None else None


@dataclass
class MlpWeights:
    gate: torch.Tensor | Fp8Weight  # [I, H]
    up: torch.Tensor | Fp8Weight  # [I, H]
    down: torch.Tensor | Fp8Weight  # [H, I]


@dataclass
class MoeWeights:
    router: torch.Tensor  # [E, H]
    router_scale: torch.Tensor  # [H]
    per_expert_scale: torch.Tensor  # [E]
    gate_up: torch.Tensor | Fp8Weight  # [E, 2I, H]: gate rows, then up rows
    down: torch.Tensor | Fp8Weight  # [E, H, I]
    pre_norm: torch.Tensor  # [H] fp32: pre_feedforward_layernorm_2
    post_norm_mlp: torch.Tensor  # [H] fp32: post_feedforward_layernorm_1
    post_norm_experts: torch.Tensor  # [H] fp32: post_feedforward_layernorm_2
    first_expert: int = 0  # under expert parallel gate_up[j] is expert first_expert + j's


@dataclass
class PleWeights:
    gate: torch.Tensor  # [P, H]: per_layer_input_gate
    projection: torch.Tensor  # [H, P]: per_layer_projection
    post_norm: torch.Tensor  # [H] fp32: post_per_layer_input_norm


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H] fp32
    post_attention_norm: torch.Tensor  # [H] fp32
    pre_mlp_norm: torch.Tensor  # [H] fp32
    post_mlp_norm: torch.Tensor  # [H] fp32
    attention: AttentionWeights
    mlp: MlpWeights
    moe: MoeWeights | None
    ple: PleWeights | None
    layer_scalar: torch.Tensor  # [1]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H] fp32
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    ple_embed: torch.Tensor | None  # [V_ple, L*P]: embed_tokens_per_layer
    ple_projection: torch.Tensor | None  # [L*P, H]: per_layer_model_projection
    ple_norm: torch.Tensor | None  # [P] fp32: per_layer_projection_norm


def text_prefix(ckpt: "Checkpoint") -> str:
    """Where the text model's tensors live in this checkpoint."""
    for prefix in TEXT_PREFIXES:
        if ckpt.has(prefix + "embed_tokens.weight"):
            return prefix
    names = " or ".join(p + "embed_tokens.weight" for p in TEXT_PREFIXES)
    raise CheckpointError(f"no Gemma 4 text model in {ckpt.path}: found neither {names}")


def load_weights(
    ckpt: "Checkpoint", cfg: Gemma4Config, device: str, dtype: torch.dtype
) -> ModelWeights:
    read = TensorReader(ckpt, device, dtype, text_prefix(ckpt))
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = read("embed_tokens.weight", v, h)
    layers = [layer_weights(read, cfg, layer) for layer in cfg.layers]
    ple_embed = ple_projection = ple_norm = None
    if cfg.has_ple:
        lp = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
        ple_embed = read("embed_tokens_per_layer.weight", cfg.vocab_size_per_layer_input, lp)
        ple_projection = read("per_layer_model_projection.weight", lp, h)
        ple_norm = read.upcast("per_layer_projection_norm.weight", cfg.hidden_size_per_layer_input)
    split_vocab = shards.vocab_parallel(cfg, ckpt.shard.world)
    lm_head = read.lm_head(embed, cfg.tie_word_embeddings, split_vocab)
    return ModelWeights(
        embed, read.upcast("norm.weight", h), lm_head, layers, ple_embed, ple_projection, ple_norm
    )


def layer_weights(read: TensorReader, cfg: Gemma4Config, layer: Layer) -> LayerWeights:
    """One decoder layer's weights (a reuse layer: no k/v projections or k_norm; also the
    assistant's layers, assistant.py)."""
    h, p = cfg.hidden_size, f"layers.{layer.index}"
    moe = _moe(read, cfg, p) if cfg.enable_moe_block else None
    ple = None
    if cfg.has_ple:
        ps = cfg.hidden_size_per_layer_input
        ple = PleWeights(
            read(f"{p}.per_layer_input_gate.weight", ps, h),
            read(f"{p}.per_layer_projection.weight", h, ps),
            read.upcast(f"{p}.post_per_layer_input_norm.weight", h),
        )
    m = f"{p}.mlp"
    mlp = MlpWeights(
        read.linear(f"{m}.gate_proj.weight", layer.mlp_size, h),
        read.linear(f"{m}.up_proj.weight", layer.mlp_size, h),
        read.linear(f"{m}.down_proj.weight", h, layer.mlp_size),
    )
    return LayerWeights(
        input_norm=read.upcast(f"{p}.input_layernorm.weight", h),
        post_attention_norm=read.upcast(f"{p}.post_attention_layernorm.weight", h),
        pre_mlp_norm=read.upcast(f"{p}.pre_feedforward_layernorm.weight", h),
        post_mlp_norm=read.upcast(f"{p}.post_feedforward_layernorm.weight", h),
        attention=_attention(read, cfg, layer, f"{p}.self_attn"),
        mlp=mlp,
        moe=moe,
        ple=ple,
        layer_scalar=read(f"{p}.layer_scalar", 1),
    )


def _attention(read: TensorReader, cfg: Gemma4Config, layer: Layer, a: str) -> AttentionWeights:
    h, d = cfg.hidden_size, layer.head_dim
    q, kv = cfg.num_attention_heads * d, layer.kv_heads * d
    own = not layer.reuses_kv
    return AttentionWeights(
        q=read.linear(f"{a}.q_proj.weight", q, h),
        k=read.linear(f"{a}.k_proj.weight", kv, h) if own else None,
        v=read.linear(f"{a}.v_proj.weight", kv, h) if own and not layer.k_eq_v else None,
        o=read.linear(f"{a}.o_proj.weight", h, q),
        q_norm=read.upcast(f"{a}.q_norm.weight", d),
        k_norm=read.upcast(f"{a}.k_norm.weight", d) if own else None,
    )


def _moe(read: TensorReader, cfg: Gemma4Config, p: str) -> MoeWeights:
    h, i, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    return MoeWeights(
        router=read(f"{p}.router.proj.weight", e, h),
        router_scale=read(f"{p}.router.scale", h),
        per_expert_scale=read(f"{p}.router.per_expert_scale", e),
        gate_up=read.linear(f"{p}.experts.gate_up_proj", e, 2 * i, h),
        down=read.linear(f"{p}.experts.down_proj", e, h, i),
        pre_norm=read.upcast(f"{p}.pre_feedforward_layernorm_2.weight", h),
        post_norm_mlp=read.upcast(f"{p}.post_feedforward_layernorm_1.weight", h),
        post_norm_experts=read.upcast(f"{p}.post_feedforward_layernorm_2.weight", h),
        first_expert=read.ckpt.shard.experts(e).start,
    )
