"""Random vision-tower weights drawn in place on the device (as dummy.py does for the text model):
for the tower's GPU checks and its benchmark at GLM-5.3-Flash's vision shape, with no
checkpoint to read.

`REAL` is `Glm5NextVisionConfig`'s class defaults (24 blocks of width 1024, 16 heads, MLP 4096,
patch 14, merge 2) with out_hidden_size the text model's hidden size (4096), which the tower's
rows must have to be placed. Each product's weights are scaled by 1/sqrt(fan-in), so activations
stay O(1) through the blocks; norms are 1 + N(0, 0.1²).
"""

from __future__ import annotations

import torch

from tensorfold.engine.dummy_draws import Draws

from .vision_config import VisionConfig
from .vision_weights import VisionBlockWeights, VisionWeights

__all__ = ["REAL", "dummy_vision_weights"]

REAL = VisionConfig(out_hidden_size=4096)


def dummy_vision_weights(
    cfg: VisionConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0
) -> VisionWeights:
    draw = Draws(device, dtype, seed, std=0.02)
    d, i, o, proj = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.out_hidden_size,
        (cfg.projection_intermediate_size),
    )

    def w(rows: int, cols: int) -> torch.Tensor:
        return draw.normal(rows, cols, std=cols**-0.5)

    def norm(size: int) -> torch.Tensor:
        return draw.norm(size).to(dtype)

    def bias(size: int) -> torch.Tensor | None:
        return draw.normal(size) if cfg.attention_bias else None

    blocks = [
        VisionBlockWeights(
            norm1=norm(d),
            norm2=norm(d),
            qkv=w(3 * d, d),
            qkv_bias=bias(3 * d),
            q_norm=norm(cfg.head_dim),
            k_norm=norm(cfg.head_dim),
            proj=w(d, d),
            proj_bias=bias(d),
            gate=w(i, d),
            gate_bias=bias(i),
            up=w(i, d),
            up_bias=bias(i),
            down=w(d, i),
            down_bias=bias(d),
        )
        for _ in range(cfg.depth)
    ]
    m2 = cfg.spatial_merge_size**2
    return VisionWeights(
        cfg=cfg,
        patch=w(d, cfg.patch_dim),
        patch_bias=draw.normal(d),
        blocks=blocks,
        post_norm=norm(d),
        downsample=w(o, m2 * d),
        downsample_bias=draw.normal(o),
        merger_proj=w(o, o),
        merger_norm=norm(o),
        merger_norm_bias=draw.normal(o),
        merger_gate=w(proj, o),
        merger_up=w(proj, o),
        merger_down=w(o, proj),
    )
