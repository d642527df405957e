"""LFM2-MoE over the pool's pages: short-conv and GQA layers, dense and MoE FFNs."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.family import ModelShape, StateLayout
from tensorfold.family.checkpoint import torch_dtype
from tensorfold.family.forward_pass import ForwardPass
from tensorfold.family.model import FamilyModel
from tensorfold.ops import moe as moe_ops
from tensorfold.ops import parallel, rope
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import add_rms_norm, rms_norm

from . import layers, shards
from .config import Lfm2MoeConfig
from .weights import AttentionWeights, ModelWeights, load_weights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots
    from tensorfold.family.checkpoint import Checkpoint

DTYPES = ("float32", "bfloat16", "float16")


def load(checkpoint: "Checkpoint", device: str, dtype: str) -> "Lfm2MoeModel":
    """Parse config.json and load the weights in `dtype` (one of DTYPES) onto `device`."""
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"lfm2_moe runs in {', '.join(DTYPES)}, not {dtype!r}")
    cfg = Lfm2MoeConfig.from_dict(checkpoint.config, str(checkpoint.path / "config.json"))
    tdtype = torch_dtype(dtype)
    return Lfm2MoeModel(cfg, load_weights(checkpoint, cfg, device, tdtype), device, tdtype)


def shape(config: dict, dtype: str) -> ModelShape:
    """The memory plan's view of a checkpoint, from config.json alone."""
    cfg = Lfm2MoeConfig.from_dict(config, "config.json")
    return ModelShape(state_layout(cfg, torch_dtype(dtype)), cfg.max_position_embeddings)


def state_layout(cfg: Lfm2MoeConfig, dtype: torch.dtype, world: int = 1) -> StateLayout:
    """Attention layers page K and V rows [kv_heads, head_dim]; conv layers keep their tail
    (the last K-1 values of B⊙x) per stream, [H, K-1]; one rank's share at `world` ranks (see
    shards.py). Any row is a usable mark."""
    return shards.state_layout(cfg, str(dtype).removeprefix("torch."), world)


class Lfm2MoeModel(FamilyModel):
    name = "lfm2_moe"
    verify_graphs = True  # its conv taps a uniform verify pass by row (ops.conv.gated_conv)

    def __init__(self, cfg: Lfm2MoeConfig, weights: ModelWeights, device: str, dtype: torch.dtype):
        self.cfg = cfg
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = parallel.current()  # this rank of tp.world: its weights are its shard's
        self.layout = state_layout(cfg, dtype, self.tp.world)
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings
        self.inv_freq = rope.inv_freq(cfg.head_dim, cfg.rope_theta, self.device)  # [D/2] fp32

    def forward(self, fp: ForwardPass, rows: "PagedRows", slots: "StreamSlots") -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        h = w.embed.index_select(0, fp.tokens)  # [N, H]
        cos, sin = rope.cos_sin(fp.positions, self.inv_freq, self.dtype)  # [N, D]
        n = len(w.layers)
        x = rms_norm(h, w.layers[0].operator_norm, cfg.norm_eps) if n else h
        for i, layer in enumerate(w.layers):
            if isinstance(layer.mixer, AttentionWeights):
                y = layers.attention(cfg, f"L{i}", layer.mixer, x, cos, sin, fp, rows)
            else:
                y = layers.short_conv(f"L{i}", layer.mixer, x, fp, slots)
            f, h = layers.norm_feed_forward(cfg, layer.ffn, layer.ffn_norm, y, h)  # h = y + h
            if i + 1 < n:
                x, h = add_rms_norm(f, h, w.layers[i + 1].operator_norm, cfg.norm_eps)
            else:
                h = h + moe_ops.summed(f)
        out = rms_norm(h.index_select(0, fp.logit_rows), w.final_norm, cfg.norm_eps)
        if self.tp.world > 1 and shards.vocab_parallel(cfg, self.tp.world):
            return parallel.gather_columns(linear(out, w.lm_head)).float()  # [R, V]
        return linear(out, w.lm_head, out_dtype=torch.float32)  # [R, V], rounded, stored as fp32
