"""Gemma 4's text model over the pool's pages: sliding-window and full attention layers, the dense
GeGLU beside the MoE, per-layer embeddings and KV sharing between layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.checkpoint import torch_dtype
from tensorfold.family import ModelShape, RowSpec, StateLayout, StateSpec
from tensorfold.forward_pass import ForwardPass
from tensorfold.logs import get_logger
from tensorfold.model import FamilyModel
from tensorfold.ops import rope as rope_ops
from tensorfold.ops.linear import linear

from .config import Gemma4Config, Rope
from .layers import decoder_layer
from .ops import rms_norm, softcap
from .sliding import SlidingRows, ring_specs
from .weights import ModelWeights, load_weights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots
    from tensorfold.checkpoint import Checkpoint

DTYPES = ("float32", "bfloat16", "float16")
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
log = get_logger("tensorfold_gemma4")


def load(checkpoint: "Checkpoint", device: str, dtype: str) -> "Gemma4Model":
    """Parse config.json and load the text weights in `dtype` (one of DTYPES) onto `device`."""
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"gemma4 runs in {', '.join(DTYPES)}, not {dtype!r}")
    cfg = Gemma4Config.from_dict(checkpoint.config, str(checkpoint.path / "config.json"))
    towers = sorted({t.split(".")[1] for n in checkpoint.tensor_names() for t in TOWERS
                     if n.startswith(t)})
    if cfg.has_vision or cfg.has_audio or towers:
        log.warning(
            "gemma4: serving the text model only; images and audio are not served yet",
            vision=cfg.has_vision, audio=cfg.has_audio, towers_skipped=towers,
        )
    tdtype = torch_dtype(dtype)
    return Gemma4Model(cfg, load_weights(checkpoint, cfg, device, tdtype), device, tdtype)


def shape(config: dict, dtype: str) -> ModelShape:
    """The memory plan's view of a checkpoint, from config.json alone."""
    cfg = Gemma4Config.from_dict(config, "config.json")
    return ModelShape(state_layout(cfg, torch_dtype(dtype)), cfg.max_position_embeddings)


def state_layout(cfg: Gemma4Config, dtype: torch.dtype) -> StateLayout:
    """Each full layer that owns its K/V pages K and V rows [kv_heads, head_dim]; each sliding one
    keeps rings of its last W-1 rows a stream as fixed state (sliding.py), which snapshots carry;
    reuse layers read their store layer's rows and hold none. Any row is a usable mark."""
    name = str(dtype).removeprefix("torch.")
    owners = [layer for layer in cfg.layers if not layer.reuses_kv]
    paged = tuple(
        RowSpec(f"L{layer.index}.{kv}", (layer.kv_heads, layer.head_dim), name)
        for layer in owners if layer.window is None for kv in ("k", "v")
    )
    fixed: tuple[StateSpec, ...] = tuple(
        spec for layer in owners if layer.window is not None for spec in ring_specs(layer, name)
    )
    return StateLayout(paged=paged, fixed=fixed, mark_rows=1)


def inv_freq(rope: Rope, head_dim: int, device: torch.device) -> torch.Tensor:
    """[head_dim // 2] fp32, as Gemma4TextRotaryEmbedding and modeling_rope_utils build it."""
    if rope.rope_type == "default":
        return rope_ops.inv_freq(head_dim, rope.theta, device)
    angles = int(rope.partial_rotary_factor * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / head_dim
    rotated = 1.0 / (rope.theta**exponents)
    identity = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)
    return torch.cat((rotated, identity)) / rope.factor


class Gemma4Model(FamilyModel):
    name = "gemma4"

    def __init__(self, cfg: Gemma4Config, weights: ModelWeights, device: str, dtype: torch.dtype):
        self.cfg = cfg
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.layout = state_layout(cfg, dtype)
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings
        self.inv_freq = {  # [D/2] fp32 by layer kind
            kind: inv_freq(rope, cfg.head_dim(kind), self.device) for kind, rope in cfg.rope.items()
        }
        # The scaled embeddings multiply by a scale rounded to the weights' dtype first.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(self.device, dtype)
        self.ple_scale = torch.tensor(cfg.hidden_size_per_layer_input**0.5).to(self.device, dtype)
        self.placeholders = torch.tensor(cfg.multimodal_token_ids, dtype=torch.long,
                                         device=self.device)
        self.shared_kv = frozenset(layer.kv_source for layer in cfg.layers if layer.reuses_kv)

    def forward(self, fp: ForwardPass, rows: "PagedRows", slots: "StreamSlots") -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        ids = fp.tokens
        if self.placeholders.numel():  # no image, video or audio fills them: the pad embedding
            ids = torch.where(torch.isin(ids, self.placeholders), cfg.pad_token_id, ids)
        h = w.embed.index_select(0, ids) * self.embed_scale  # [N, H]
        ple = self.per_layer_inputs(ids, h) if cfg.has_ple else None  # [N, L, P]
        rope = {kind: rope_ops.cos_sin(fp.positions, f, self.dtype)  # [N, D] each
                for kind, f in self.inv_freq.items()}
        sliding = SlidingRows(fp, slots, self.shared_kv)
        for layer, lw in zip(cfg.layers, w.layers):
            cos, sin = rope[layer.kind]
            p = ple[:, layer.index] if ple is not None else None
            h = decoder_layer(cfg, layer, lw, h, cos, sin, p, fp, rows, sliding)
        out = rms_norm(h.index_select(0, fp.logit_rows), w.final_norm, cfg.rms_norm_eps)
        return softcap(linear(out, w.lm_head), cfg.final_logit_softcapping).float()  # [R, V]

    def per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """ids [N], h [N, H] (the scaled embeddings) -> [N, L, P]: (RMSNorm(proj(h) · H^-0.5) +
        embed_per_layer(ids) · √P) · 2^-0.5."""
        cfg, w = self.cfg, self.weights
        assert w.ple_embed is not None and w.ple_projection is not None
        n, layers, size = ids.shape[0], cfg.num_hidden_layers, cfg.hidden_size_per_layer_input
        tokens = (w.ple_embed.index_select(0, ids) * self.ple_scale).view(n, layers, size)
        projected = linear(h, w.ple_projection) * cfg.hidden_size**-0.5
        projected = rms_norm(projected.view(n, layers, size), w.ple_norm, cfg.rms_norm_eps)
        return (projected + tokens) * 2.0**-0.5
