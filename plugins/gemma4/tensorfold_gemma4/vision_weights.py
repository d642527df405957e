"""The vision tower's weights (`model.vision_tower.*`) and its embedder's (`model.embed_vision.*`),
under their on-disk names, shape-checked as they load.

Every tower linear is a Gemma4ClippableLinear: its weight under `<name>.linear.weight`, and with
`use_clipped_linears` four scalar bounds beside it (input_min/max, output_min/max) that clamp its
input and output. Norm weights are kept in fp32, as the reference upcasts them. The tower is read
whole on every rank (no tensor-parallel cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorfold.family.checkpoint import TensorReader

from .vision_config import VisionConfig

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

TOWER_PREFIX = "model.vision_tower."
EMBEDDER_PREFIX = "model.embed_vision."


@dataclass
class ClippedLinear:
    weight: torch.Tensor  # [N, K]
    bounds: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # fp32 scalars


@dataclass
class VisionLayerWeights:
    q: ClippedLinear  # [heads*D, Hv]
    k: ClippedLinear  # [kv_heads*D, Hv]
    v: ClippedLinear  # [kv_heads*D, Hv]
    o: ClippedLinear  # [Hv, heads*D]
    q_norm: torch.Tensor  # [D] fp32
    k_norm: torch.Tensor  # [D] fp32
    gate: ClippedLinear  # [I, Hv]
    up: ClippedLinear  # [I, Hv]
    down: ClippedLinear  # [Hv, I]
    input_norm: torch.Tensor  # [Hv] fp32
    post_attention_norm: torch.Tensor  # [Hv] fp32
    pre_mlp_norm: torch.Tensor  # [Hv] fp32
    post_mlp_norm: torch.Tensor  # [Hv] fp32


@dataclass
class VisionWeights:
    input_proj: torch.Tensor  # [Hv, 3·patch²]
    positions: torch.Tensor  # [2, position_embedding_size, Hv]: x table, y table
    layers: list[VisionLayerWeights]
    std_bias: torch.Tensor | None  # [Hv] fp32, with `standardize`
    std_scale: torch.Tensor | None  # [Hv] fp32
    projection: torch.Tensor  # [H_text, Hv]: embed_vision.embedding_projection


def load_vision_weights(
    ckpt: "Checkpoint", cfg: VisionConfig, device: str, dtype: torch.dtype
) -> VisionWeights:
    read = TensorReader(ckpt, device, dtype, TOWER_PREFIX)
    hv, ps = cfg.hidden_size, cfg.position_embedding_size
    layers = [_layer(read, cfg, f"encoder.layers.{i}") for i in range(cfg.num_hidden_layers)]
    std_bias = std_scale = None
    if cfg.standardize:
        std_bias = read.upcast("std_bias", hv)
        std_scale = read.upcast("std_scale", hv)
    embed = TensorReader(ckpt, device, dtype, EMBEDDER_PREFIX)
    return VisionWeights(
        input_proj=read("patch_embedder.input_proj.weight", hv, cfg.patch_width),
        positions=read("patch_embedder.position_embedding_table", 2, ps, hv),
        layers=layers,
        std_bias=std_bias,
        std_scale=std_scale,
        projection=embed("embedding_projection.weight", cfg.text_hidden_size, hv),
    )


def _layer(read: TensorReader, cfg: VisionConfig, p: str) -> VisionLayerWeights:
    hv, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def linear(name: str, n: int, k: int) -> ClippedLinear:
        bounds = None
        if cfg.use_clipped_linears:
            names = ("input_min", "input_max", "output_min", "output_max")
            b = [read(f"{name}.{s}", dtype=torch.float32) for s in names]
            bounds = (b[0], b[1], b[2], b[3])
        return ClippedLinear(read(f"{name}.linear.weight", n, k), bounds)

    a, m = f"{p}.self_attn", f"{p}.mlp"
    return VisionLayerWeights(
        q=linear(f"{a}.q_proj", q, hv),
        k=linear(f"{a}.k_proj", kv, hv),
        v=linear(f"{a}.v_proj", kv, hv),
        o=linear(f"{a}.o_proj", hv, q),
        q_norm=read.upcast(f"{a}.q_norm.weight", d),
        k_norm=read.upcast(f"{a}.k_norm.weight", d),
        gate=linear(f"{m}.gate_proj", i, hv),
        up=linear(f"{m}.up_proj", i, hv),
        down=linear(f"{m}.down_proj", hv, i),
        input_norm=read.upcast(f"{p}.input_layernorm.weight", hv),
        post_attention_norm=read.upcast(f"{p}.post_attention_layernorm.weight", hv),
        pre_mlp_norm=read.upcast(f"{p}.pre_feedforward_layernorm.weight", hv),
        post_mlp_norm=read.upcast(f"{p}.post_feedforward_layernorm.weight", hv),
    )
