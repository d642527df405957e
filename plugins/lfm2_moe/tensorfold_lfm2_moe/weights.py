"""The weights of an LFM2-MoE checkpoint under their on-disk names, shape-checked as they load.

On disk (as transformers 5.23.0 saves and real checkpoints ship): per-expert w1/w2/w3, the conv
weight as [H, 1, K], `feed_forward.expert_bias` in fp32, and no `lm_head.weight` when the
embeddings are tied.

Under tensor parallel the checkpoint hands each tensor's slice for this rank (shards.py says how
each is cut; the shapes below are the whole tensors on disk, and the comments' widths are one
rank's), and only this rank's experts are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.family.checkpoint import TensorReader
from tensorfold.ops.fp8 import Fp8Weight, cat_rows

from . import shards
from .config import ATTENTION, Lfm2MoeConfig

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint


@dataclass
class AttentionWeights:
    """q, k and v are made row slices of one tensor, qkv, at construction (every path that builds
    these weights, a rank's shards too): one product computes all three, in no more memory."""

    q: torch.Tensor | Fp8Weight  # [heads*D, H]
    k: torch.Tensor | Fp8Weight  # [kv_heads*D, H]
    v: torch.Tensor | Fp8Weight  # [kv_heads*D, H]
    out: torch.Tensor | Fp8Weight  # [H, heads*D]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    # [(heads + 2*kv_heads)*D, H]: q, k, v
    qkv: torch.Tensor | Fp8Weight = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.qkv = cat_rows((self.q, self.k, self.v))
        self.q, self.k, self.v = self.qkv.split((len(self.q), len(self.k), len(self.v)))


@dataclass
class ConvWeights:
    in_proj: torch.Tensor | Fp8Weight  # [3H, H]: rows B, C, x
    in_bias: torch.Tensor | None  # [3H]
    conv: torch.Tensor  # [H, K]
    conv_bias: torch.Tensor | None  # [H]
    out_proj: torch.Tensor | Fp8Weight  # [H, H]
    out_bias: torch.Tensor | None  # [H]


@dataclass
class DenseWeights:
    w1: torch.Tensor | Fp8Weight  # [I, H]
    w3: torch.Tensor | Fp8Weight  # [I, H]
    w2: torch.Tensor | Fp8Weight  # [H, I]


@dataclass
class MoeWeights:
    gate: torch.Tensor  # [E, H]
    expert_bias: torch.Tensor | None  # [E] fp32
    w1: Sequence[torch.Tensor] | Fp8Weight  # [E, I, H] stacked as loaded (or E views of one)
    w3: Sequence[torch.Tensor] | Fp8Weight  # [E, I, H]
    w2: Sequence[torch.Tensor] | Fp8Weight  # [E, H, I]
    first_expert: int = 0  # under expert parallel w1[j] is expert first_expert + j's


@dataclass
class LayerWeights:
    operator_norm: torch.Tensor  # [H]
    ffn_norm: torch.Tensor  # [H]
    mixer: AttentionWeights | ConvWeights
    ffn: DenseWeights | MoeWeights


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    final_norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    layers: list[LayerWeights]


def load_weights(
    ckpt: "Checkpoint", cfg: Lfm2MoeConfig, device: str, dtype: torch.dtype
) -> ModelWeights:
    read = TensorReader(ckpt, device, dtype)
    h, v = cfg.hidden_size, cfg.vocab_size
    embed = read("model.embed_tokens.weight", v, h)
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        mixer = _attention(read, cfg, p) if kind == ATTENTION else _conv(read, cfg, p)
        ffn = _dense(read, cfg, p) if cfg.is_dense(i) else _moe(read, cfg, p)
        layers.append(
            LayerWeights(
                read(f"{p}.operator_norm.weight", h), read(f"{p}.ffn_norm.weight", h), mixer, ffn
            )
        )
    split_vocab = ckpt.shard.world > 1 and shards.vocab_parallel(cfg, ckpt.shard.world)
    lm_head = read.lm_head(embed, cfg.tie_word_embeddings, split_vocab)
    return ModelWeights(embed, read("model.embedding_norm.weight", h), lm_head, layers)


def _attention(read: TensorReader, cfg: Lfm2MoeConfig, p: str) -> AttentionWeights:
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    a = f"{p}.self_attn"
    return AttentionWeights(
        q=read.linear(f"{a}.q_proj.weight", q, h),
        k=read.linear(f"{a}.k_proj.weight", kv, h),
        v=read.linear(f"{a}.v_proj.weight", kv, h),
        out=read.linear(f"{a}.out_proj.weight", h, q),
        q_norm=read(f"{a}.q_layernorm.weight", d),
        k_norm=read(f"{a}.k_layernorm.weight", d),
    )


def _conv(read: TensorReader, cfg: Lfm2MoeConfig, p: str) -> ConvWeights:
    h, k, bias = cfg.hidden_size, cfg.conv_L_cache, cfg.conv_bias
    c = f"{p}.conv"
    return ConvWeights(
        in_proj=read.linear(f"{c}.in_proj.weight", 3 * h, h),
        in_bias=read.bias(f"{c}.in_proj.bias", 3 * h, bias),
        conv=read(f"{c}.conv.weight", h, 1, k).reshape(-1, k),
        conv_bias=read.bias(f"{c}.conv.bias", h, bias),
        out_proj=read.linear(f"{c}.out_proj.weight", h, h),
        out_bias=read.bias(f"{c}.out_proj.bias", h, bias),
    )


def _dense(read: TensorReader, cfg: Lfm2MoeConfig, p: str) -> DenseWeights:
    h, i = cfg.hidden_size, cfg.intermediate_size
    f = f"{p}.feed_forward"
    return DenseWeights(
        read.linear(f"{f}.w1.weight", i, h),
        read.linear(f"{f}.w3.weight", i, h),
        read.linear(f"{f}.w2.weight", h, i),
    )


def _moe(read: TensorReader, cfg: Lfm2MoeConfig, p: str) -> MoeWeights:
    h, i, n = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    f = f"{p}.feed_forward"
    bias = read(f"{f}.expert_bias", n, dtype=torch.float32) if cfg.use_expert_bias else None
    local = read.ckpt.shard.experts(n)
    experts = [f"{f}.experts.{e}" for e in local]
    return MoeWeights(
        gate=read(f"{f}.gate.weight", n, h),
        expert_bias=bias,
        w1=read.experts([f"{e}.w1.weight" for e in experts], i, h),
        w3=read.experts([f"{e}.w3.weight" for e in experts], i, h),
        w2=read.experts([f"{e}.w2.weight" for e in experts], h, i),
        first_expert=local.start,
    )
