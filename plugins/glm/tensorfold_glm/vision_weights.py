"""GLM-5.3-Flash's vision tower: its config.json fields and its weights under their on-disk names.

transformers 5.23.0 `Glm5NextVisionConfig` / `Glm5NextVisionModel` (`model.visual.` on disk):
a Conv3d patch embedding, `depth` ViT blocks, a post-RMSNorm, a Conv2d 2 x 2 downsample to
out_hidden_size and the patch merger. The text model's loader (weights.py) does not read these;
`load_vision_weights` does, only when config.json has a vision_config. The convolutions are
kept as the linear maps they are (each kernel covers exactly its stride): the patch embedding
over a pixel row's (channel, time, y, x) values, the downsample over a 2 x 2 block's
(row, column, channel) values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tensorfold.family.checkpoint import TensorReader

from .vision_config import VisionConfig

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

__all__ = ["VISION_PREFIX", "VisionBlockWeights", "VisionConfig", "VisionWeights"]

VISION_PREFIX = "model.visual."


@dataclass
class VisionBlockWeights:
    norm1: torch.Tensor  # [D]
    norm2: torch.Tensor  # [D]
    qkv: torch.Tensor  # [3D, D]: q, k, v rows, each head by head
    qkv_bias: torch.Tensor | None  # [3D]
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    proj: torch.Tensor  # [D, D]
    proj_bias: torch.Tensor | None  # [D]
    gate: torch.Tensor  # [I, D]
    gate_bias: torch.Tensor | None  # [I]
    up: torch.Tensor  # [I, D]
    up_bias: torch.Tensor | None  # [I]
    down: torch.Tensor  # [D, I]
    down_bias: torch.Tensor | None  # [D]


@dataclass
class VisionWeights:
    cfg: VisionConfig
    patch: torch.Tensor  # [D, patch_dim]: the Conv3d kernel, flattened (c, t, y, x)
    patch_bias: torch.Tensor  # [D]
    blocks: list[VisionBlockWeights]
    post_norm: torch.Tensor  # [D]
    downsample: torch.Tensor  # [O, m*m*D]: the Conv2d kernel, flattened (y, x, channel)
    downsample_bias: torch.Tensor  # [O]
    merger_proj: torch.Tensor  # [O, O]
    merger_norm: torch.Tensor  # [O]: LayerNorm weight
    merger_norm_bias: torch.Tensor  # [O]
    merger_gate: torch.Tensor  # [P, O]
    merger_up: torch.Tensor  # [P, O]
    merger_down: torch.Tensor  # [O, P]


def load_vision_weights(
    ckpt: "Checkpoint", device: str, dtype: torch.dtype
) -> VisionWeights | None:
    """The tower's weights, or None where config.json has no vision_config."""
    raw = ckpt.config.get("vision_config")
    if not isinstance(raw, dict):
        return None
    cfg = VisionConfig.from_dict(raw, f"{ckpt.path / 'config.json'} (vision_config)")
    read = TensorReader(ckpt, device, dtype, VISION_PREFIX)
    d, o, m, p = cfg.hidden_size, cfg.out_hidden_size, cfg.spatial_merge_size, cfg.patch_size
    conv3d = read("patch_embed.proj.weight", d, cfg.in_channels, cfg.temporal_patch_size, p, p)
    conv2d = read("downsample.weight", o, d, m, m)
    return VisionWeights(
        cfg=cfg,
        patch=conv3d.reshape(d, -1).contiguous(),
        patch_bias=read("patch_embed.proj.bias", d),
        blocks=[_block(read, cfg, f"blocks.{i}") for i in range(cfg.depth)],
        post_norm=read("post_layernorm.weight", d),
        downsample=conv2d.permute(0, 2, 3, 1).reshape(o, -1).contiguous(),
        downsample_bias=read("downsample.bias", o),
        merger_proj=read("merger.proj.weight", o, o),
        merger_norm=read("merger.post_projection_norm.weight", o),
        merger_norm_bias=read("merger.post_projection_norm.bias", o),
        merger_gate=read("merger.gate_proj.weight", cfg.projection_intermediate_size, o),
        merger_up=read("merger.up_proj.weight", cfg.projection_intermediate_size, o),
        merger_down=read("merger.down_proj.weight", o, cfg.projection_intermediate_size),
    )


def _block(read: TensorReader, cfg: VisionConfig, p: str) -> VisionBlockWeights:
    d, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.attention_bias
    return VisionBlockWeights(
        norm1=read(f"{p}.norm1.weight", d),
        norm2=read(f"{p}.norm2.weight", d),
        qkv=read(f"{p}.attn.qkv.weight", 3 * d, d),
        qkv_bias=read.bias(f"{p}.attn.qkv.bias", 3 * d, bias),
        q_norm=read(f"{p}.attn.q_norm.weight", cfg.head_dim),
        k_norm=read(f"{p}.attn.k_norm.weight", cfg.head_dim),
        proj=read(f"{p}.attn.proj.weight", d, d),
        proj_bias=read.bias(f"{p}.attn.proj.bias", d, bias),
        gate=read(f"{p}.mlp.gate_proj.weight", i, d),
        gate_bias=read.bias(f"{p}.mlp.gate_proj.bias", i, bias),
        up=read(f"{p}.mlp.up_proj.weight", i, d),
        up_bias=read.bias(f"{p}.mlp.up_proj.bias", i, bias),
        down=read(f"{p}.mlp.down_proj.weight", d, i),
        down_bias=read.bias(f"{p}.mlp.down_proj.bias", d, bias),
    )
