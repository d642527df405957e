"""The audio tower's weights (`model.audio_tower.*`) and its embedder's (`model.embed_audio.*`),
under their on-disk names, shape-checked as they load.

The Conformer's linears are Gemma4ClippableLinears (vision_weights.ClippedLinear): a weight under
`<name>.linear.weight` and, with `use_clipped_linears`, four scalar bounds beside it. The
subsampling convs, the relative-position key projection and the output projection are plain.
Norm weights and `per_dim_scale` are kept in fp32, as the reference upcasts them. Read whole on
every rank (no tensor-parallel cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorfold.family.checkpoint import TensorReader

from .audio_config import AudioConfig
from .vision_weights import ClippedLinear

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

TOWER_PREFIX = "model.audio_tower."
EMBEDDER_PREFIX = "model.embed_audio."


@dataclass
class FeedForwardWeights:
    up: ClippedLinear  # [4·Ha, Ha] ffw_layer_1
    down: ClippedLinear  # [Ha, 4·Ha] ffw_layer_2
    pre_norm: torch.Tensor  # [Ha] fp32
    post_norm: torch.Tensor  # [Ha] fp32


@dataclass
class AudioLayerWeights:
    ffn1: FeedForwardWeights
    ffn2: FeedForwardWeights
    q: ClippedLinear  # [Ha, Ha]
    k: ClippedLinear  # [Ha, Ha]
    v: ClippedLinear  # [Ha, Ha]
    post: ClippedLinear  # [Ha, Ha]: the attention's output projection
    relative_k: torch.Tensor  # [Ha, Ha]
    per_dim_scale: torch.Tensor  # [D] fp32
    conv_start: ClippedLinear  # [2·Ha, Ha]: lconv1d.linear_start, then a GLU
    conv_end: ClippedLinear  # [Ha, Ha]
    depthwise: torch.Tensor  # [Ha, 1, kernel]
    conv_pre_norm: torch.Tensor  # [Ha] fp32
    conv_norm: torch.Tensor  # [Ha] fp32
    norm_pre_attn: torch.Tensor  # [Ha] fp32
    norm_post_attn: torch.Tensor  # [Ha] fp32
    norm_out: torch.Tensor  # [Ha] fp32


@dataclass
class AudioWeights:
    conv0: torch.Tensor  # [C0, 1, 3, 3]
    conv0_norm: torch.Tensor  # [C0] fp32 (a LayerNorm without bias)
    conv1: torch.Tensor  # [C1, C0, 3, 3]
    conv1_norm: torch.Tensor  # [C1] fp32
    input_proj: torch.Tensor  # [Ha, (C0 // 4)·C1]
    layers: list[AudioLayerWeights]
    output_proj: torch.Tensor  # [out, Ha]
    output_bias: torch.Tensor  # [out]
    projection: torch.Tensor  # [H_text, out]: embed_audio.embedding_projection


def load_audio_weights(
    ckpt: "Checkpoint", cfg: AudioConfig, device: str, dtype: torch.dtype
) -> AudioWeights:
    read = TensorReader(ckpt, device, dtype, TOWER_PREFIX)
    ha, (c0, c1), out = cfg.hidden_size, cfg.subsampling_conv_channels, cfg.output_proj_dims
    sub = "subsample_conv_projection"
    embed = TensorReader(ckpt, device, dtype, EMBEDDER_PREFIX)
    return AudioWeights(
        conv0=read(f"{sub}.layer0.conv.weight", c0, 1, 3, 3),
        conv0_norm=read.upcast(f"{sub}.layer0.norm.weight", c0),
        conv1=read(f"{sub}.layer1.conv.weight", c1, c0, 3, 3),
        conv1_norm=read.upcast(f"{sub}.layer1.norm.weight", c1),
        input_proj=read(f"{sub}.input_proj_linear.weight", ha, cfg.subsampled_width),
        layers=[_layer(read, cfg, f"layers.{i}") for i in range(cfg.num_hidden_layers)],
        output_proj=read("output_proj.weight", out, ha),
        output_bias=read("output_proj.bias", out),
        projection=embed("embedding_projection.weight", cfg.text_hidden_size, out),
    )


def _layer(read: TensorReader, cfg: AudioConfig, p: str) -> AudioLayerWeights:
    ha, d = cfg.hidden_size, cfg.head_dim

    def linear(name: str, n: int, k: int) -> ClippedLinear:
        bounds = None
        if cfg.use_clipped_linears:
            names = ("input_min", "input_max", "output_min", "output_max")
            b = [read(f"{name}.{s}", dtype=torch.float32) for s in names]
            bounds = (b[0], b[1], b[2], b[3])
        return ClippedLinear(read(f"{name}.linear.weight", n, k), bounds)

    def ffn(f: str) -> FeedForwardWeights:
        return FeedForwardWeights(
            up=linear(f"{f}.ffw_layer_1", 4 * ha, ha),
            down=linear(f"{f}.ffw_layer_2", ha, 4 * ha),
            pre_norm=read.upcast(f"{f}.pre_layer_norm.weight", ha),
            post_norm=read.upcast(f"{f}.post_layer_norm.weight", ha),
        )

    a, c = f"{p}.self_attn", f"{p}.lconv1d"
    return AudioLayerWeights(
        ffn1=ffn(f"{p}.feed_forward1"),
        ffn2=ffn(f"{p}.feed_forward2"),
        q=linear(f"{a}.q_proj", ha, ha),
        k=linear(f"{a}.k_proj", ha, ha),
        v=linear(f"{a}.v_proj", ha, ha),
        post=linear(f"{a}.post", ha, ha),
        relative_k=read(f"{a}.relative_k_proj.weight", ha, ha),
        per_dim_scale=read.upcast(f"{a}.per_dim_scale", d),
        conv_start=linear(f"{c}.linear_start", 2 * ha, ha),
        conv_end=linear(f"{c}.linear_end", ha, ha),
        depthwise=read(f"{c}.depthwise_conv1d.weight", ha, 1, cfg.conv_kernel_size),
        conv_pre_norm=read.upcast(f"{c}.pre_layer_norm.weight", ha),
        conv_norm=read.upcast(f"{c}.conv_norm.weight", ha),
        norm_pre_attn=read.upcast(f"{p}.norm_pre_attn.weight", ha),
        norm_post_attn=read.upcast(f"{p}.norm_post_attn.weight", ha),
        norm_out=read.upcast(f"{p}.norm_out.weight", ha),
    )
