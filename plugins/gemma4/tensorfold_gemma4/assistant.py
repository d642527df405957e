"""Gemma 4's assistant drafter: transformers 5.23.0's `Gemma4AssistantForCausalLM`
(models/gemma4_assistant/) driven as `SinglePositionMultiTokenCandidateGenerator` drives it
(generation/candidate_generator.py), for verify rounds (plugins/gemma4/README.md says how).

What it reads, for a stream at position p whose next token is x (rows [0, p) fed to the target,
x drawn from row p - 1's logits, not yet fed):
- `tokens` [B]: x;
- `hidden` [B, Ht]: the target's last hidden state of row p - 1 AFTER its final norm (what
  `hidden_states[-1]` holds: the input of the lm_head; `Gemma4Model.pass_hidden` keeps it);
- `positions` [B]: p (the same for all k steps: the drafter has no cache of its own);
- `kv`: the K/V rows of the target's last "store" layer of each kind (`store_layers`), as
  `KVRows` (transformers' `shared_kv_states` layout [B, Hkv, T, D]), never written.

One step (`Gemma4Assistant.step`), in the model dtype with the family's ops (ops.py, layers.py):
  h = pre_projection([target_embed(x)·√Ht ‖ hidden])                     [B, Ha]
  each layer (all "reuse": no k/v projections): q = rope_p(q_norm(q_proj(input_norm(h)))),
    attention (scaling 1.0, GQA, fp32 softmax) over the target's rows of the layer's kind —
    full: all given rows; sliding with window W: the LAST W + 1 given rows (transformers'
    bidirectional sliding mask |q - kv| <= W over the rows flipped to the past) —, then the
    sandwich norms, the GeGLU and layer_scalar as the target's decoder layer;
  n = norm(h); logits = lm_head(n) (tied, no softcap), or the centroid-masked head: the top
    `centroid_top_k` of `num_centroids` centroid logits pick their clusters' tokens
    (`token_ordering`), those get n·embedding, all others min(selected) - 1;
  next hidden = post_projection(n)                                         [B, Ht]
and `draft` runs k greedy steps, each feeding its argmax and next hidden to the next.
Outputs: logits [B, V] (`draft`: [B, k, V]) fp32, tokens [B] ([B, k]).

Interface: `load_assistant(checkpoint, target_model) -> Gemma4Assistant`, on the target's device
and dtype; `.step(tokens, hidden, positions, kv) -> DraftStep(logits, tokens, hidden)`;
`.draft(tokens, hidden, positions, kv, k) -> Draft(tokens, logits)`. In the engine `kv` comes from
`assistant_kv.gather_shared_kv` (after the pass that drew x, before the next one writes) and
`hidden` from `Gemma4Model.pass_hidden(runner.last_pass)`.

Streams are independent: attention and the masked head run a stream at a time (its rows only,
the mask value its own minimum; transformers takes the batch's), every product row-invariant
(`linear`), so a stream's drafts do not depend on what shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from tensorfold.family.checkpoint import CheckpointError, TensorReader
from tensorfold.ops import rope as rope_ops
from tensorfold.ops.attention import rows_dot, weighted_rows
from tensorfold.ops.linear import linear

from . import layers
from .assistant_config import AssistantConfig
from .config import Gemma4Config
from .model import inv_freq
from .ops import residual, rms_norm
from .weights import LayerWeights, layer_weights

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

    from .model import Gemma4Model


@dataclass
class KVRows:
    """One layer kind's K/V rows of the target for B streams, in position order: keys
    [B, Hkv, T, D], values [B, Hkv, T, Dv] (transformers' shared_kv_states layout). Stream b's
    rows are [0, lengths[b]) (the rest padding, never read); lengths None: all T. Row
    lengths[b] - 1 is position p - 1; sliding rows may start later than position 0 (a ring)."""

    keys: torch.Tensor
    values: torch.Tensor
    lengths: list[int] | None = None

    def length(self, b: int) -> int:
        return self.keys.shape[2] if self.lengths is None else self.lengths[b]


SharedKV = Mapping[str, KVRows]  # by layer kind: config.SLIDING, config.FULL


def store_layers(cfg: Gemma4Config) -> dict[str, int]:
    """The target layer of each kind whose K/V an assistant reads: with KV sharing the last layer
    before the first reuse layer of that kind (transformers' "store" layers); without, the last
    layer of the kind (an extension: transformers 5.23.0 returns no shared_kv_states then)."""
    reuse = [layer.index for layer in cfg.layers if layer.reuses_kv]
    end = min(reuse) if reuse else cfg.num_hidden_layers
    out: dict[str, int] = {}
    for layer in cfg.layers[:end]:
        out[layer.kind] = layer.index
    return out


@dataclass
class AssistantWeights:
    pre_projection: torch.Tensor  # [Ha, 2*Ht]
    post_projection: torch.Tensor  # [Ht, Ha]
    layers: list[LayerWeights]  # attention: q, q_norm, o only
    final_norm: torch.Tensor  # [Ha] fp32
    lm_head: torch.Tensor  # [V, Ha]: the tied embeddings
    centroids: torch.Tensor | None  # [C, Ha]: masked_embedding.centroids
    token_ordering: torch.Tensor | None  # [V] int64: cluster c's tokens at [c*V/C, (c+1)*V/C)


@dataclass
class DraftStep:
    logits: torch.Tensor  # [B, V] fp32
    tokens: torch.Tensor  # [B] int64: the greedy token (argmax)
    hidden: torch.Tensor  # [B, Ht] model dtype: the next step's `hidden`


@dataclass
class Draft:
    tokens: torch.Tensor  # [B, k] int64
    logits: torch.Tensor  # [B, k, V] fp32


class Gemma4Assistant:
    """An assistant checkpoint on the target's device and dtype; `target_embed` [V, Ht] and
    `embed_scale` (√Ht rounded to the dtype) embed the token it reads, as the target does."""

    def __init__(
        self,
        cfg: AssistantConfig,
        weights: AssistantWeights,
        target_embed: torch.Tensor,
        embed_scale: torch.Tensor,
    ):
        self.cfg = cfg
        self.weights = weights
        self.target_embed = target_embed
        self.embed_scale = embed_scale
        self.device = target_embed.device
        self.dtype = weights.pre_projection.dtype
        text = cfg.text
        self.inv_freq = {  # [D/2] fp32 by layer kind
            kind: inv_freq(r, text.head_dim(kind), self.device) for kind, r in text.rope.items()
        }

    @torch.inference_mode()
    def step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv: SharedKV
    ) -> DraftStep:
        """One draft token a stream: tokens [B], hidden [B, Ht], positions [B] (see module doc)."""
        cfg, w = self.cfg.text, self.weights
        eps = cfg.rms_norm_eps
        embedded = self.target_embed.index_select(0, tokens) * self.embed_scale  # [B, Ht]
        h = linear(torch.cat([embedded, hidden.to(self.dtype)], dim=-1), w.pre_projection)
        rope = {
            kind: rope_ops.cos_sin(positions, f, self.dtype) for kind, f in self.inv_freq.items()
        }
        x = rms_norm(h, w.layers[0].input_norm, eps)
        b = h.shape[0]
        for i, (layer, lw) in enumerate(zip(cfg.layers, w.layers)):
            cos, sin = rope[layer.kind]
            a = lw.attention
            q = linear(x, a.q).view(b, -1, layer.head_dim)
            q = rope_ops.norm_rope(q, a.q_norm, eps, cos, sin, fp32_weight=True, norm=rms_norm)
            o = attend(q, kv[layer.kind], layer.window)
            a_out = linear(o.reshape(b, -1), a.o)
            h, mlp_in = residual(h, a_out, eps, wa=lw.post_attention_norm, wnext=lw.pre_mlp_norm)
            assert mlp_in is not None
            nxt = w.layers[i + 1].input_norm if i + 1 < len(w.layers) else w.final_norm
            m = layers.mlp(lw.mlp, mlp_in)
            h, normed = residual(h, m, eps, wa=lw.post_mlp_norm, scale=lw.layer_scalar, wnext=nxt)
            assert normed is not None
            x = normed  # after the last layer: the final norm of h
        logits = self._head(x).float()
        return DraftStep(logits, logits.argmax(dim=-1), linear(x, w.post_projection))

    def draft(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv: SharedKV,
        k: int,
    ) -> Draft:
        """k greedy draft tokens a stream (k >= 1): each step reads the last one's token and
        hidden, at the same positions and over the same K/V."""
        out_tokens, out_logits = [], []
        for _ in range(k):
            s = self.step(tokens, hidden, positions, kv)
            tokens, hidden = s.tokens, s.hidden
            out_tokens.append(s.tokens)
            out_logits.append(s.logits)
        return Draft(torch.stack(out_tokens, dim=1), torch.stack(out_logits, dim=1))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, Ha] (final-normed) -> [B, V] in the model dtype: the tied head, or the
        centroid-masked one."""
        w = self.weights
        if w.centroids is None or w.token_ordering is None:
            return linear(x, w.lm_head)
        c, per = self.cfg.num_centroids, self.cfg.tokens_per_centroid
        top = torch.topk(linear(x, w.centroids), self.cfg.centroid_top_k, dim=-1).indices
        chosen = w.token_ordering.view(c, per)[top].flatten(1)  # [B, top_k * per] token ids
        out = x.new_empty(x.shape[0], self.cfg.text.vocab_size)
        for b in range(x.shape[0]):
            picked = linear(x[b : b + 1], w.lm_head.index_select(0, chosen[b]))[0]
            out[b] = picked.min() - 1.0
            out[b].scatter_(0, chosen[b], picked)
        return out


def attend(q: torch.Tensor, rows: KVRows, window: int | None) -> torch.Tensor:
    """q [B, Hq, D] (one query a stream) over each stream's rows: all of them, or with a window W
    the last W + 1 (see module doc). Query head h reads KV head h // (Hq / Hkv); scaling 1.0;
    scores, softmax and sums in fp32. Returns [B, Hq, Dv] in q's dtype."""
    n_streams, hq, d = q.shape
    out = q.new_empty(n_streams, hq, rows.values.shape[-1])
    for b in range(n_streams):
        end = rows.length(b)
        if end < 1:
            raise ValueError(f"stream {b}: an assistant step needs at least one target row")
        start = 0 if window is None else max(0, end - window - 1)
        keys = rows.keys[b, :, start:end].float()  # [Hkv, T, D]
        values = rows.values[b, :, start:end].float()  # [Hkv, T, Dv]
        qh = q[b].float().view(keys.shape[0], -1, d)  # [Hkv, G, D]
        p = torch.softmax(rows_dot(qh, keys), dim=-1)  # [Hkv, G, T]
        out[b] = weighted_rows(p, values).reshape(hq, -1).to(q.dtype)
    return out


def load_assistant(checkpoint: "Checkpoint", target: "Gemma4Model") -> Gemma4Assistant:
    """An assistant checkpoint (names as transformers saves it: `model.layers.*`,
    `model.embed_tokens.weight` (the tied head), `model.norm.weight`, `pre_projection.weight`,
    `post_projection.weight`, `masked_embedding.{centroids.weight, token_ordering}`) for
    `target`, on its device in its dtype; its shapes checked against the target's."""
    source = str(checkpoint.path / "config.json")
    cfg = AssistantConfig.from_dict(checkpoint.config, source)
    check_pair(cfg, target.cfg, source)
    text, device, dtype = cfg.text, str(target.device), target.dtype
    read, top = (TensorReader(checkpoint, device, dtype, p) for p in ("model.", ""))
    ha, ht, v = text.hidden_size, cfg.backbone_hidden_size, text.vocab_size
    embed = read("embed_tokens.weight", v, ha)
    centroids = ordering = None
    if cfg.use_ordered_embeddings:
        centroids = top("masked_embedding.centroids.weight", cfg.num_centroids, ha)
        ordering = top("masked_embedding.token_ordering", v, dtype=torch.long)
        if not torch.equal(ordering.sort().values, torch.arange(v, device=ordering.device)):
            raise CheckpointError(f"{checkpoint.path}: token_ordering is not a permutation")
    weights = AssistantWeights(
        pre_projection=top("pre_projection.weight", ha, 2 * ht),
        post_projection=top("post_projection.weight", ht, ha),
        layers=[layer_weights(read, text, layer) for layer in text.layers],
        final_norm=read.upcast("norm.weight", ha),
        lm_head=top.lm_head(embed, True, False),
        centroids=centroids,
        token_ordering=ordering,
    )
    return Gemma4Assistant(cfg, weights, target.weights.embed, target.embed_scale)


def check_pair(cfg: AssistantConfig, target: Gemma4Config, source: str) -> None:
    """The assistant fits the target: its backbone width and vocabulary are the target's, and
    each of its layers' head_dim is that of the target's store layer of its kind."""
    text = cfg.text
    if cfg.backbone_hidden_size != target.hidden_size or text.vocab_size != target.vocab_size:
        raise CheckpointError(
            f"{source}: backbone_hidden_size={cfg.backbone_hidden_size}, vocab_size="
            f"{text.vocab_size}; the target has hidden_size={target.hidden_size}, vocab_size="
            f"{target.vocab_size}"
        )
    stores = store_layers(target)
    for layer in text.layers:
        store = stores.get(layer.kind)
        theirs = None if store is None else target.layers[store]
        if theirs is None or theirs.head_dim != layer.head_dim:
            got = "no such layer" if theirs is None else f"head_dim {theirs.head_dim}"
            raise CheckpointError(
                f"{source}: assistant layer {layer.index} ({layer.kind}, head_dim "
                f"{layer.head_dim}) reads the target's last {layer.kind} layer: {got}"
            )
        if text.num_attention_heads % theirs.kv_heads:
            raise CheckpointError(
                f"{source}: {text.num_attention_heads} query heads do not group over the "
                f"target's {theirs.kv_heads} {layer.kind} KV heads"
            )
