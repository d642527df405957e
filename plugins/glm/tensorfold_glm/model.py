"""glm5_next over the pool's pages: the text model of GLM-5.3-Flash as transformers 5.23.0
computes it (`Glm5NextTextModel` and the `lm_head` of `Glm5NextForConditionalGeneration`).

The embedding is copied into hc_mult residual streams; each layer wraps its mixer (KDA or MLA)
and its FFN (SwiGLU or MoE) in an mHC collapse / expand; the streams' mean is normed and
projected to logits. A checkpoint's MTP layer (weights.mtp) is loaded beside the trunk; this
forward keeps the MTP's carry (the last row's hidden state) and, on `forward(..., hidden=buf)`,
hands back the hidden state each row's MTP row reads. While the MTP drafts (`--draft mtp`,
mtp_drafter.py sets `mtp_rows`), the forward runs the MTP layer's rows for every row of the pass
right after the trunk's (mtp.mtp_rows), so its K/V or KDA state stays current for every stream.

Images (config.json's vision_config): `load` reads the vision tower (vision_weights.py) beside
the text model, `encode_media` runs it on each image alone (vision.py), and a prompt pass holding
image rows writes their embeddings over the placeholder tokens' before the streams are copied
out (`ForwardPass.place_embeds`), as the reference's masked_scatter does before its hc_mult
expand. The text layers are NoPE: an image's rows are positions like any other.

Under tensor parallel (`--tp N`, shards.py) each rank holds its heads, FFN columns and experts;
the residual streams are whole and the same on every rank (each mixer and FFN ends in one sum
over the ranks), and a vocab-parallel lm_head's logits are gathered in rank order. The vision
tower is whole on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.config.logs import get_logger
from tensorfold.family import StateLayout
from tensorfold.family.checkpoint import torch_dtype
from tensorfold.family.forward_pass import ForwardPass, StackedTaps
from tensorfold.family.media import MediaPiece, tower_batches
from tensorfold.family.model import FamilyModel
from tensorfold.ops import parallel
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import rms_norm

from . import indexer, mhc, shards
from .config import GlmConfig
from .kda import kda, rows_each_by_row
from .layout import DTYPES, carry_name, shape, state_layout
from .media_processor import GlmImage
from .mla import mla
from .moe import ffn
from .vision import image_embeddings, image_token_counts
from .vision_memory import DEFAULT_MAX_ROWS
from .vision_weights import VisionWeights, load_vision_weights
from .weights import KdaWeights, LayerWeights, ModelWeights, has_mtp, load_weights, text_prefix

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
    weights = load_weights(checkpoint, cfg, device, torch_dtype(name))
    vision = load_vision_weights(checkpoint, device, torch_dtype(name))
    if vision is not None and vision.cfg.out_hidden_size != cfg.hidden_size:
        raise ValueError(
            f"{checkpoint.path / 'config.json'}: the vision tower's out_hidden_size "
            f"{vision.cfg.out_hidden_size} is not the text hidden_size {cfg.hidden_size}"
        )
    return GlmModel(cfg, weights, device, name, vision)


def _note_unserved(checkpoint: "Checkpoint", cfg: GlmConfig) -> None:
    names = checkpoint.tensor_names()
    if not cfg.has_vision and any(n.startswith("model.visual.") for n in names):
        log.info(
            "glm5_next: config.json has no vision_config, so the checkpoint's vision tower "
            "(model.visual.*) is not loaded; images are not served"
        )
    mtp = f"{text_prefix(checkpoint)}layers.{cfg.num_hidden_layers}."
    present = any(n.startswith(mtp) for n in names)
    if present and cfg.mtp_layer is None:
        log.info(
            f"glm5_next: the MTP layer ({mtp}*) is not loaded: --draft mtp drafts with it "
            "(where config.json declares num_nextn_predict_layers)"
        )
    elif present and not has_mtp(checkpoint, cfg):
        log.info(f"glm5_next: the MTP layer ({mtp}*) is not loaded under tensor parallel")
    elif cfg.mtp_layer is not None and not present:
        log.info(
            "glm5_next: config.json declares an MTP layer the checkpoint does not carry; "
            "its state rows stay in the layout, unused"
        )


class GlmModel(FamilyModel):
    name = "glm5_next"
    verify_graphs = True  # a uniform verify pass taps by row from the device meta (kda, _carry)

    def __init__(
        self,
        cfg: GlmConfig,
        weights: ModelWeights,
        device: str,
        dtype: str,
        vision: VisionWeights | None = None,
    ):
        self.cfg = cfg
        self.weights = weights
        self.vision = vision  # the image tower, None for a text-only checkpoint
        self.device = torch.device(device)
        self.dtype = torch_dtype(dtype)
        self.tp = parallel.current()  # this rank of tp.world: its weights are its shard's
        self.layout: StateLayout = state_layout(cfg, dtype, self.tp.world)
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings
        # the MTP layer's input carried across passes (layout.py), when the layout has it
        carry = carry_name(cfg) if cfg.mtp_layer is not None else None
        self.carry = carry if carry in {s.name for s in self.layout.fixed} else None
        # the MTP layer's rows run in every pass, after the trunk's (the MTP drafter sets it)
        self.mtp_rows = False

    def forward(
        self,
        fp: ForwardPass,
        rows: "PagedRows",
        slots: "StreamSlots",
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The pass's logits [R, V] fp32. Each op takes its Triton kernel on the GPU
        (`tensorfold.ops.gpu.use_triton`); a decode pass reads nothing back to the host, so the
        graph runner can capture it (per-stream layout from `pass_meta(fp)` only).

        With an MTP layer in the layout, each stream's carry (`L{N}.carry`) becomes the hidden
        state h of its last row (the mean of its streams after the last layer, what the final
        norm reads), and a tap at p records h_{p-1}. hidden: None, or an [N, H] tensor in the
        model dtype (N = fp.num_rows) this pass fills with what the MTP's row j reads, h_{j-1}:
        zeros at position 0, the carry as it stood for a run's first row (mtp.py). None and no
        MTP layer cost nothing. With `mtp_rows` on, the MTP layer then runs the pass's rows
        (row j reads h_{j-1} and the token t_j; no logits), writing its own rows and state."""
        cfg, w = self.cfg, self.weights
        if hidden is not None and self.carry is None:
            raise ValueError("glm5_next: hidden= needs an MTP layer in config.json")
        if fp.embed_rows is None:
            streams = mhc.streams_in(w.embed, fp.tokens, cfg.hc_mult)  # [N, hc, H]
        else:  # image rows: their embeddings over the placeholders', then the hc copies
            x = fp.place_embeds(w.embed.index_select(0, fp.tokens))
            streams = x[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
        layers = [(f"L{i}", layer) for i, layer in enumerate(w.layers)]
        streams = decoder_layers(cfg, layers, streams, fp, rows, slots)
        if self.carry is not None:
            if self.mtp_rows and hidden is None:
                hidden = torch.empty(
                    fp.num_rows, cfg.hidden_size, dtype=self.dtype, device=streams.device
                )
            self._carry(fp, streams, slots, self.carry, hidden)
            if self.mtp_rows:
                from .mtp import mtp_rows  # mtp.py builds on this module

                assert hidden is not None
                mtp_rows(self, fp, rows, slots, hidden)
        h = mhc.head_of_rows(streams, fp.logit_rows)  # [R, H]
        normed = rms_norm(h, w.final_norm, cfg.rms_norm_eps)
        return self.logits(normed, w.lm_head)

    def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
        """Each image's rows [piece.rows, H] in the model dtype on its device. Images go through
        the tower several in one pass, as `tower_batches` groups them within the rows the memory
        plan counts it at; an image's rows are the same bits whatever shares its pass."""
        if self.vision is None:
            raise ValueError("glm5_next: this checkpoint has no vision tower (vision_config)")
        for piece in pieces:
            if piece.kind != "image" or not isinstance(piece.inputs, GlmImage):
                raise ValueError(f"glm5_next takes images, not {piece.kind} {piece.inputs!r}")
        out = []
        for batch in tower_batches([p.rows for p in pieces], DEFAULT_MAX_ROWS):
            images = [pieces[i].inputs for i in batch]
            grid = torch.tensor([image.grid_thw for image in images], dtype=torch.long)
            pixels = torch.cat([image.pixel_values for image in images]).to(self.device)
            with torch.no_grad():
                rows = image_embeddings(self.vision, pixels, grid)
            counts = image_token_counts(grid, self.vision.cfg)
            for i, part in zip(batch, rows.split(counts)):
                if part.shape[0] != pieces[i].rows:
                    raise ValueError(
                        f"an image of grid {pieces[i].inputs.grid_thw} gives {part.shape[0]} "
                        f"rows, its piece holds {pieces[i].rows}"
                    )
                out.append(part.to(self.dtype))
        return out

    def _carry(
        self,
        fp: ForwardPass,
        streams: torch.Tensor,
        slots: "StreamSlots",
        name: str,
        hidden: torch.Tensor | None,
    ) -> None:
        """Fill `hidden` with each row's h_{j-1}, tap the carry, then set each stream's carry
        to its last row's h. Device tensors only (pass_meta): a decode pass stays capturable."""
        from tensorfold.ops.pass_meta import pass_meta

        meta, carry = pass_meta(fp), slots.get(name)  # carry [slots, H]
        slot = meta.stream_slot.long()
        row0 = meta.stream_row0.long()
        last = row0 + meta.stream_len.long() - 1  # [S]
        n = fp.num_rows
        every = None
        by_row = rows_each_by_row(fp, streams)  # a uniform verify pass: taps by row (kda.py)
        if hidden is not None or by_row or any(s.taps for s in fp.streams):
            every = mhc.head_of_rows(streams, torch.arange(n, device=streams.device))  # [N, H]
        if hidden is not None:
            assert every is not None
            kept = carry.index_select(0, slot)
            before = torch.where((meta.stream_start > 0)[:, None], kept, torch.zeros_like(kept))
            rows = torch.arange(n, device=streams.device)
            owner = meta.row_stream.long()
            source = torch.where(rows == row0[owner], n + owner, rows - 1)
            hidden.copy_(torch.cat([every, before]).index_select(0, source))
        if by_row:  # h after each stream's rows 1..R-1
            assert every is not None
            fp.tap_rows(name, StackedTaps(every.view(-1, by_row, every.shape[-1])[:, :-1]))
        else:
            for i, stream in enumerate(fp.streams):
                for p in stream.taps:
                    assert every is not None
                    fp.tap(i, p, name, every[fp.spans[i][0] + p - 1 - stream.start].clone())
        ends = every.index_select(0, last) if every is not None else mhc.head_of_rows(streams, last)
        carry.index_copy_(0, slot, ends)

    def logits(self, normed: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """[R, H] normed rows -> [R, V] fp32 logits through `head` (lm_head or the MTP's)."""
        if shards.vocab_parallel(self.cfg, self.tp.world):  # the ranks' vocabularies in order
            return parallel.gather_columns(linear(normed, head)).float()
        return linear(normed, head, out_dtype=torch.float32)  # rounded, stored as fp32


def decoder_layers(
    cfg: GlmConfig,
    layers: Sequence[tuple[str, LayerWeights]],
    streams: torch.Tensor,
    fp: ForwardPass,
    rows: "PagedRows",
    slots: "StreamSlots",
) -> torch.Tensor:
    """Run `layers` (each with the name of its state, "L{i}") over the pass's streams
    [N, hc, H]; returns the streams after the last. Each expand and the collapse after it are
    one step (one launch at a few rows)."""
    masks: indexer.Selection | None = None  # the last MLA layer's key sets, per stream
    first = layers[0][1]
    post, comb, x = mhc.collapse_norm(cfg, first.attn_hc, streams, first.input_norm)
    for j, (name, layer) in enumerate(layers):
        if isinstance(layer.mixer, KdaWeights):
            y = kda(cfg, name, layer.mixer, x, fp, slots)
            masks = None  # a "shared" layer reads only the layer just before it
        else:
            y, masks = mla(cfg, name, layer.mixer, x, fp, rows, masks)
        streams, post, comb, x = mhc.expand_collapse_norm(
            cfg, layer.ffn_hc, post, comb, y, streams, layer.post_norm
        )
        y = ffn(cfg, x, layer.ffn)
        if j + 1 < len(layers):
            after = layers[j + 1][1]
            streams, post, comb, x = mhc.expand_collapse_norm(
                cfg, after.attn_hc, post, comb, y, streams, after.input_norm
            )
        else:
            streams = mhc.expand(post, comb, y, streams)
    return streams
