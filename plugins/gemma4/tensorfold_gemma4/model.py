"""Gemma 4's text model over the pool's pages: sliding-window and full attention layers, the dense
GeGLU beside the MoE, per-layer embeddings and KV sharing between layers.

The forward makes no host sync (no .item(), no device-dependent python branch), so a decode pass
can be captured in a CUDA graph (core/engine/cuda_graphs.py); the sandwich norms' residual adds are
fused with the norm that follows them (ops.residual)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.config.logs import get_logger
from tensorfold.family import ModelShape, StateLayout
from tensorfold.family.checkpoint import torch_dtype
from tensorfold.family.forward_pass import ForwardPass
from tensorfold.family.media import MediaPiece, tower_batches
from tensorfold.family.model import FamilyModel
from tensorfold.ops import parallel
from tensorfold.ops import rope as rope_ops
from tensorfold.ops.linear import linear

from . import layers, shards
from .audio import audio_embeddings
from .audio_config import LONGEST_CLIP_FRAMES, MEL_BINS, AudioConfig, audio_config
from .audio_weights import AudioWeights, load_audio_weights
from .config import Gemma4Config, Layer, Rope
from .media import GemmaClip, GemmaImage
from .ops import residual, residual_router, rms_norm, softcap_float
from .sliding import SlidingRows
from .vision import images_embeddings
from .vision_config import VisionConfig, vision_config
from .vision_weights import VisionWeights, load_vision_weights
from .weights import LayerWeights, ModelWeights, load_weights

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots
    from tensorfold.family.checkpoint import Checkpoint

DTYPES = ("float32", "bfloat16", "float16")
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
VISION_TOWERS = ("model.vision_tower.", "model.embed_vision.")
AUDIO_TOWERS = ("model.audio_tower.", "model.embed_audio.")
log = get_logger("tensorfold_gemma4")


def load(checkpoint: "Checkpoint", device: str, dtype: str) -> "Gemma4Model":
    """Parse config.json and load the text weights in `dtype` (one of DTYPES) onto `device`,
    the vision tower's (vision_weights.py) when config.json has a vision_config, and the audio
    tower's (audio_weights.py) when it has an audio_config."""
    if str(dtype).removeprefix("torch.") not in DTYPES:
        raise ValueError(f"gemma4 runs in {', '.join(DTYPES)}, not {dtype!r}")
    source = str(checkpoint.path / "config.json")
    cfg = Gemma4Config.from_dict(checkpoint.config, source)
    vision_cfg = vision_config(checkpoint.config, source) if cfg.has_vision else None
    audio_cfg = audio_config(checkpoint.config, source) if cfg.has_audio else None
    loaded = (VISION_TOWERS if vision_cfg is not None else ()) + (
        AUDIO_TOWERS if audio_cfg is not None else ()
    )
    towers = sorted(
        {
            t.split(".")[1]
            for n in checkpoint.tensor_names()
            for t in TOWERS
            if n.startswith(t) and t not in loaded
        }
    )
    if towers:
        log.warning(
            "gemma4: tower weights without a config to read them by are skipped",
            vision=cfg.has_vision,
            audio=cfg.has_audio,
            towers_skipped=towers,
        )
    tdtype = torch_dtype(dtype)
    model = Gemma4Model(cfg, load_weights(checkpoint, cfg, device, tdtype), device, tdtype)
    if vision_cfg is not None:
        model.vision_cfg = vision_cfg
        model.vision_weights = load_vision_weights(checkpoint, vision_cfg, device, tdtype)
    if audio_cfg is not None:
        model.audio_cfg = audio_cfg
        model.audio_weights = load_audio_weights(checkpoint, audio_cfg, device, tdtype)
    return model


def shape(config: dict, dtype: str) -> ModelShape:
    """The memory plan's view of a checkpoint, from config.json alone: with a vision tower, its
    activations on the largest image Gemma 4's processor may give, and with an audio tower
    its activations on the longest clip; the larger of the two, as the pieces are encoded
    one at a time (the towers' weights are counted with the checkpoint's)."""
    cfg = Gemma4Config.from_dict(config, "config.json")
    tdtype = torch_dtype(dtype)
    vision = vision_config(config) if cfg.has_vision else None
    audio = audio_config(config) if cfg.has_audio else None
    media = 0
    if vision is not None:
        media = vision.activation_bytes(vision.largest_image_patches, tdtype.itemsize)
    if audio is not None:
        clip = audio.activation_bytes(LONGEST_CLIP_FRAMES, MEL_BINS, tdtype.itemsize)
        media = max(media, clip)
    return ModelShape(state_layout(cfg, tdtype), cfg.max_position_embeddings, media)


def state_layout(cfg: Gemma4Config, dtype: torch.dtype, world: int = 1) -> StateLayout:
    """Each full layer that owns its K/V pages K and V rows [kv_heads, head_dim]; each sliding one
    keeps rings of its last W-1 rows a stream as fixed state (sliding.py), which snapshots carry;
    reuse layers read their store layer's rows and hold none; one rank's KV heads at `world`
    ranks (shards.py). Any row is a usable mark."""
    return shards.state_layout(cfg, str(dtype).removeprefix("torch."), world)


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
    verify_graphs = True  # its rings tap a uniform verify pass by row (ring_taps.py)

    def __init__(self, cfg: Gemma4Config, weights: ModelWeights, device: str, dtype: torch.dtype):
        self.cfg = cfg
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = dtype
        self.tp = parallel.current()  # this rank of tp.world: its weights are its shard's
        self.layout = state_layout(cfg, dtype, self.tp.world)
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.max_position_embeddings
        self.inv_freq = {  # [D/2] fp32 by layer kind
            kind: inv_freq(rope, cfg.head_dim(kind), self.device) for kind, rope in cfg.rope.items()
        }
        # The scaled embeddings multiply by a scale rounded to the weights' dtype first.
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5).to(self.device, dtype)
        self.ple_scale = torch.tensor(cfg.hidden_size_per_layer_input**0.5).to(self.device, dtype)
        self.placeholders = torch.tensor(
            cfg.multimodal_token_ids, dtype=torch.long, device=self.device
        )
        self.shared_kv = frozenset(layer.kv_source for layer in cfg.layers if layer.reuses_kv)
        # [R, H]: a pass's logit rows after the final norm (the lm_head's input), which an
        # assistant drafter reads (assistant.py): by pass (pass_hidden), and the last forward's
        # (under CUDA graphs the last captured graph's, not the one replayed)
        self.last_hidden: torch.Tensor | None = None
        # the vision tower (vision.py), when the checkpoint has one (encode_media)
        self.vision_cfg: VisionConfig | None = None
        self.vision_weights: VisionWeights | None = None
        # the audio tower (audio.py), when the checkpoint has one (E-models)
        self.audio_cfg: AudioConfig | None = None
        self.audio_weights: AudioWeights | None = None
        self._hidden: weakref.WeakKeyDictionary[ForwardPass, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )

    def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
        """Each piece's soft tokens [piece.rows, H] in the model's dtype on its device: images
        through the vision tower (vision.images_embeddings, several in one pass as
        `tower_batches` groups them within the largest image's patches), audio through the
        audio tower a clip alone (audio.audio_embeddings). A piece's rows never depend on the
        others. A piece's inputs are its `media.GemmaImage` or `media.GemmaClip`."""
        if self.vision_weights is None and self.audio_weights is None:
            return super().encode_media(pieces)
        out: list[torch.Tensor | None] = [None] * len(pieces)
        images = []
        for i, piece in enumerate(pieces):
            if isinstance(piece.inputs, GemmaClip) and piece.kind == "audio":
                out[i] = self._encode_clip(piece.inputs)
            elif isinstance(piece.inputs, GemmaImage) and piece.kind == "image":
                images.append(i)
            else:
                raise ValueError(
                    f"gemma4 encodes images and audio, not {piece.kind} "
                    f"{type(piece.inputs).__name__}"
                )
        for i, rows in zip(images, self._encode_images([pieces[i].inputs for i in images])):
            out[i] = rows
        done = []
        for piece, rows in zip(pieces, out):
            assert rows is not None
            if rows.shape[0] != piece.rows:
                raise ValueError(
                    f"a {piece.kind} piece gives {rows.shape[0]} soft tokens, it holds "
                    f"{piece.rows} rows"
                )
            done.append(rows.to(self.dtype))
        return done

    def _encode_images(self, images: Sequence[GemmaImage]) -> list[torch.Tensor]:
        if not images:
            return []
        cfg, w = self.vision_cfg, self.vision_weights
        if cfg is None or w is None:
            raise ValueError("gemma4: an image piece, and the checkpoint has no vision tower")
        sizes = [image.pixel_values.shape[0] for image in images]
        out = []
        for batch in tower_batches(sizes, cfg.largest_image_patches):
            pairs = [
                (images[i].pixel_values.to(self.device), images[i].positions.to(self.device))
                for i in batch
            ]
            out.extend(images_embeddings(cfg, w, pairs))
        return out

    def _encode_clip(self, clip: GemmaClip) -> torch.Tensor:
        if self.audio_cfg is None or self.audio_weights is None:
            raise ValueError("gemma4: an audio piece, and the checkpoint has no audio tower")
        return audio_embeddings(self.audio_cfg, self.audio_weights, clip.features.to(self.device))

    def pass_hidden(self, fp: ForwardPass) -> torch.Tensor | None:
        """The hidden rows [R, H] of fp's logit rows after the final norm, as fp's last forward
        left them, or None: a CUDA graph's static pass (a GraphRunner's `last_pass` after a
        replay) holds its graph's own output, which each replay refreshes."""
        return self._hidden.get(fp)

    def forward(self, fp: ForwardPass, rows: "PagedRows", slots: "StreamSlots") -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        ids = fp.tokens
        if self.placeholders.numel():  # no image, video or audio fills them: the pad embedding
            # a comparison rather than torch.isin, whose CUDA path may sort (and sync)
            hit = (ids[:, None] == self.placeholders[None, :]).any(dim=-1)
            ids = torch.where(hit, cfg.pad_token_id, ids)
        h = w.embed.index_select(0, ids) * self.embed_scale  # [N, H]
        # images' rows over their placeholders' (unscaled, as masked_scatter writes them); the
        # per-layer inputs then read the pad id and these rows, as the reference's do
        h = fp.place_embeds(h)
        ple = self.per_layer_inputs(ids, h) if cfg.has_ple else None  # [N, L, P]
        rope = {
            kind: rope_ops.cos_sin(fp.positions, f, self.dtype)  # [N, D] each
            for kind, f in self.inv_freq.items()
        }
        sliding = SlidingRows(fp, slots, self.shared_kv, blocks=cfg.vision_blocks)
        x = rms_norm(h, w.layers[0].input_norm, cfg.rms_norm_eps)
        for i, (layer, lw) in enumerate(zip(cfg.layers, w.layers)):
            cos, sin = rope[layer.kind]
            p = ple[:, layer.index] if ple is not None else None
            nxt = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else None
            h, normed = decoder_layer(cfg, layer, lw, h, x, nxt, cos, sin, p, fp, rows, sliding)
            x = normed if normed is not None else x  # None after the last layer
        out = rms_norm(h.index_select(0, fp.logit_rows), w.final_norm, cfg.rms_norm_eps)
        self.last_hidden = self._hidden[fp] = out
        logits = linear(out, w.lm_head)  # [R, V], or this rank's vocabulary [R, V/world]
        if shards.vocab_parallel(cfg, self.tp.world):
            logits = parallel.gather_columns(logits)  # the softcap is elementwise: after
        return softcap_float(logits, cfg.final_logit_softcapping)  # [R, V] fp32

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


def decoder_layer(
    cfg: Gemma4Config,
    layer: Layer,
    w: LayerWeights,
    h: torch.Tensor,
    x: torch.Tensor,
    next_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ple: torch.Tensor | None,
    fp: ForwardPass,
    rows: "PagedRows",
    sliding: SlidingRows,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h [N, H] (the residual), x = input_layernorm(h); cos, sin [N, D] of the layer's kind;
    ple [N, P] (its per-layer input); next_norm: the next layer's input_layernorm weight, or None
    for the last layer. Returns (h', next_norm(h') or None).

    As modeling_gemma4.py's decoder layer: h += post_attention_norm(attention(x)); the dense
    GeGLU reads pre_feedforward_layernorm(h) and the MoE reads h itself; h += post_ffn_norm(
    post_norm_1(mlp) + post_norm_2(moe)); then the per-layer input; then h *= layer_scalar."""
    eps = cfg.rms_norm_eps
    a = layers.attention(cfg, layer, w.attention, x, cos, sin, fp, rows, sliding)
    e = None
    if w.moe is None:
        h, x = residual(h, a, eps, wa=w.post_attention_norm, wnext=w.pre_mlp_norm)
    else:  # the MoE's router and experts' inputs in the residual's launch
        # (docs/performance.md, "ROUTER_IN_RESIDUAL")
        h, x, z, xe = residual_router(
            h,
            a,
            eps,
            wa=w.post_attention_norm,
            wnext=w.pre_mlp_norm,
            router_scale=w.moe.router_scale,
            const=cfg.hidden_size**-0.5,
            pre_norm=w.moe.pre_norm,
        )
        e = layers.moe(cfg, w.moe, h, inputs=(z, xe))
    # under tensor parallel both are this rank's parts until ffn_sums adds them up
    m, e = layers.ffn_sums(layers.mlp(w.mlp, x), e)
    ffn: dict[str, torch.Tensor | None] = {"wa": w.post_mlp_norm}
    if w.moe is not None:
        ffn = {
            "wa": w.moe.post_norm_mlp,
            "e": e,
            "we": w.moe.post_norm_experts,
            "wpost": w.post_mlp_norm,
        }
    if w.ple is None:
        return residual(h, m, eps, **ffn, scale=w.layer_scalar, wnext=next_norm)
    assert ple is not None
    h, _ = residual(h, m, eps, **ffn)
    p = layers.per_layer_input(w.ple, h, ple, eps)
    return residual(h, p, eps, scale=w.layer_scalar, wnext=next_norm)
