"""glm5_next over the pool's pages: the text model of GLM-5.3-Flash as transformers 5.23.0
computes it (`Glm5NextTextModel` and the `lm_head` of `Glm5NextForConditionalGeneration`).

The embedding is copied into hc_mult residual streams; each layer wraps its mixer (KDA or MLA)
and its FFN (SwiGLU or MoE) in an mHC collapse / expand; the streams' mean is normed and
projected to logits.

Under tensor parallel (`--tp N`, shards.py) each rank holds its heads, FFN columns and experts;
the residual streams are whole and the same on every rank (each mixer and FFN ends in one sum
over the ranks), and a vocab-parallel lm_head's logits are gathered in rank order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.config.logs import get_logger
from tensorfold.family import StateLayout
from tensorfold.family.checkpoint import torch_dtype
from tensorfold.family.forward_pass import ForwardPass
from tensorfold.family.model import FamilyModel
from tensorfold.ops import parallel
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import rms_norm

from . import mhc, shards
from .config import GlmConfig
from .kda import kda
from .layout import DTYPES, shape, state_layout
from .mla import mla
from .moe import ffn
from .weights import KdaWeights, ModelWeights, load_weights, text_prefix

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots
    from tensorfold.family.checkpoint import Checkpoint

__all__ = ["GlmModel", "load", "shape", "state_layout"]

log = get_logger("tensorfold_glm")


def load(checkpoint: "Checkpoint", device: str, dtype: str) -> "GlmModel":
    """Parse config.json and load the text model's weights in `dtype` (one of DTYPES)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"glm5_next runs in {', '.join(DTYPES)}, not {dtype!r}")
    cfg = GlmConfig.from_dict(checkpoint.config, str(checkpoint.path / "config.json"))
    _note_unserved(checkpoint, cfg)
    return GlmModel(cfg, load_weights(checkpoint, cfg, device, torch_dtype(name)), device, name)


def _note_unserved(checkpoint: "Checkpoint", cfg: GlmConfig) -> None:
    names = checkpoint.tensor_names()
    if cfg.has_vision or any(n.startswith("model.visual.") for n in names):
        log.info(
            "glm5_next: the checkpoint's vision tower is not loaded; images are not served "
            "yet, only text"
        )
    mtp = f"{text_prefix(checkpoint)}layers.{cfg.num_hidden_layers}."
    if any(n.startswith(mtp) for n in names):
        log.info(f"glm5_next: the MTP layer ({mtp}*) is ignored, as transformers ignores it")


class GlmModel(FamilyModel):
    name = "glm5_next"

    def __init__(self, cfg: GlmConfig, weights: ModelWeights, device: str, dtype: str):
        self.cfg = cfg
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        self.tp = parallel.current()  # this rank of tp.world: its weights are its shard's
        self.layout: StateLayout = state_layout(cfg, dtype, self.tp.world)
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings

    def forward(self, fp: ForwardPass, rows: "PagedRows", slots: "StreamSlots") -> torch.Tensor:
        """The pass's logits [R, V] fp32. Each op takes its Triton kernel on the GPU
        (`tensorfold.ops.gpu.use_triton`); a decode pass reads nothing back to the host, so the
        graph runner can capture it (per-stream layout from `pass_meta(fp)` only)."""
        cfg, w = self.cfg, self.weights
        streams = mhc.streams_in(w.embed, fp.tokens, cfg.hc_mult)  # [N, hc, H]
        masks: list[torch.Tensor] | None = None  # the last MLA layer's key sets, per stream
        first = w.layers[0]
        post, comb, x = mhc.collapse_norm(cfg, first.attn_hc, streams, first.input_norm)
        for i, layer in enumerate(w.layers):
            if isinstance(layer.mixer, KdaWeights):
                y = kda(cfg, f"L{i}", layer.mixer, x, fp, slots)
                masks = None  # a "shared" layer reads only the layer just before it
            else:
                y, masks = mla(cfg, f"L{i}", layer.mixer, x, fp, rows, masks)
            # each expand and the collapse after it, one step (one launch at a few rows)
            streams, post, comb, x = mhc.expand_collapse_norm(
                cfg, layer.ffn_hc, post, comb, y, streams, layer.post_norm
            )
            y = ffn(cfg, x, layer.ffn)
            if i + 1 < len(w.layers):
                after = w.layers[i + 1]
                streams, post, comb, x = mhc.expand_collapse_norm(
                    cfg, after.attn_hc, post, comb, y, streams, after.input_norm
                )
            else:
                streams = mhc.expand(post, comb, y, streams)
        h = mhc.head_of_rows(streams, fp.logit_rows)  # [R, H]
        normed = rms_norm(h, w.final_norm, cfg.rms_norm_eps)
        if shards.vocab_parallel(cfg, self.tp.world):  # [R, V]: the ranks' vocabularies in order
            return parallel.gather_columns(linear(normed, w.lm_head)).float()
        return linear(normed, w.lm_head, out_dtype=torch.float32)  # rounded, stored as fp32
