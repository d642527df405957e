"""glm5_next's multi-token-prediction (MTP) layer, run as a k-step greedy drafter.

A checkpoint's layer `num_hidden_layers` (weights.MtpWeights) predicts the token after next.
What it computes follows transformers 5.23.0's generic `MtpLayer` (modeling_layers.py; the
glm5_next reference itself drops the layer) and DeepSeek-V3's MTP, in the order the checkpoint's
names give (enorm, hnorm, eh_proj, the decoder layer, shared_head.norm, shared_head.head):

    h'_i = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])     embedding first, as both do
    streams = h'_i copied hc_mult times                       as the trunk starts from embed(t)
    streams = the MTP's decoder layer (model.decoder_layers: the plugin's own mHC-wrapped
              KDA or MLA mixer and dense or MoE FFN, config's mtp_layer_type / mtp_mlp_type)
    g_i = mean of the streams                                 the MTP's own hidden state
    logits(t_{i+2}) = shared_head.head(shared_head.norm(g_i))

The hidden state h_i is the trunk's: the mean of its hc_mult streams after the last layer, the
vector the final norm reads (`GlmModel.forward(..., hidden=...)`). DeepSeek feeds the last
block's output before the final norm; with mHC that output is the streams, whose unweighted mean
(the reference's hc_head) is the single [H] vector eh_proj's [H, 2H] weight takes. A draft step
after the first feeds the MTP its own g (before shared_head.norm), as DeepSeek's k-step reuse of
one module does (and vLLM's MTP drafting): steps 2..k see the same kind of vector as step 1.
(transformers' MtpModel chains the post-normed output from one MTP layer into the next; with one
MTP layer it drafts one token and never chains.)

Rows: the MTP keeps K/V (or a KDA state) like any glm layer, under its own name "L{N}"
(layout.py), and its row j is the token at position j: it reads (h_{j-1}, t_j) and predicts
t_{j+1}, so, like every layer's, a row's bits depend on the tokens up to its own position alone
(DeepSeek's (h_i, t_{i+1}) at row i + 1; transformers' MtpModel likewise gives the MTP the
position ids of t_{i+1}). Row 0 has no row before it: its h is zeros (hnorm(0) = 0), so it
carries enorm(embed(t_0)) alone; the demo's training has the same row. glm5_next is NoPE, so
the rows line up with the trunk's: the same pages, the same indexer pools, and a prefix's rows
are the same whichever request wrote them, so the prompt store and rollback serve it as they
serve the trunk (rows past the accepted ones are rewritten by the next run over them).
The h a stream's next MTP row reads is fixed state, its carry `L{N}.carry`: the trunk's forward
sets it to the hidden state of the last row it fed and taps it like any fixed state, so a
verify round's rewind and a resumed prompt (whose rows before it no pass recomputes) leave it
right. A stream's MTP rows run one ahead of the target's: after the target's row p and the
sample x = t_{p+1}, the MTP has written rows up to p + 1.

Image rows: the MTP's row j at an image row embeds what the trunk's row j embeds, the tower's
row (`ForwardPass.place_embeds`), not the `<|image|>` placeholder's own embedding, as vLLM's
and SGLang's MTP drafters take the target's merged input embeddings. transformers' generic
MtpModel would embed the placeholder id (it takes input_ids), but glm5_next's reference has no
MTP to hold us to; either way only what is drafted changes, never a token.

Served (`--draft mtp`, mtp_drafter.py): the trunk's forward runs the MTP's rows of every pass
right after its own (`mtp_rows`, with `GlmModel.mtp_rows` on), so a stream's MTP rows are
always written up to the target's; the drafter writes row pos (the token just sampled) and
the draft rows after it, which the next pass rewrites (or which lie past the kept rows), and
puts a KDA MTP layer's state back.

Interface (tensor-shaped):
- the target pass: `GlmModel.forward(fp, rows, slots, hidden=buf)` fills buf [N, H] with the
  h_{j-1} each of its rows j reads (zeros at position 0, the carry for a run's first row), and
  leaves each stream's carry at its last row's h.
- `draft(model, rows, slots, runs, hidden, k) -> [S, k] int64`: for each stream a run of MTP
  rows (StreamRows with the tokens at their positions, as the target's runs) ending in the token
  just sampled; hidden [N - S, H] the h_{j-1} of every row but each run's last (rows of the
  target pass's buf, in the runs' order), the last row's from the stream's carry. It writes the
  rows and returns k greedy drafts: step 1 from the run's last row, steps 2..k one row each from
  the MTP's own hidden and its previous draft. Each run's pages must cover run.end + k - 1 rows.
  A KDA MTP layer's fixed state is put back to where the run left it.
  After a prompt pass over rows [s, n) (s > 0 when resumed) and the first sample x: one run of
  rows [s, n + 1) with tokens t_s..t_{n-1}, x and hidden = the pass's buf. After a verify round
  at pos (rows x, d_1..d_k, buf its hidden) accepting a drafts then sampling y, once the slot is
  rewound (carry = h_{pos+a}): rows [pos + 1, pos + a + 2) with tokens d_1..d_a, y and hidden =
  buf[1 : a + 1].
- `mtp_forward(model, fp, rows, slots, hidden) -> (logits [R, V] fp32, own [N, H])`: one pass of
  MTP rows with every row's h_{j-1} given (draft's step; tests).
- `mtp_rows(model, fp, rows, slots, hidden)`: the same rows written, nothing computed past the
  layer (the trunk's forward, serving).

Exactness: the plugin's row-invariant ops only, so a row's bits depend on its own history alone,
whether its rows come in one run or one a pass (tests/test_glm_mtp.py); greedy is argmax, the
first index on ties.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops.linear import linear
from tensorfold.ops.norms import rms_norm

from . import mhc
from .model import GlmModel, decoder_layers

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots

__all__ = ["mtp_forward", "mtp_rows", "draft", "fixed_state", "target_pass"]


def mtp_rows(
    model: GlmModel,
    fp: ForwardPass,
    rows: "PagedRows",
    slots: "StreamSlots",
    hidden: torch.Tensor,
) -> torch.Tensor:
    """The MTP layer over a pass's rows: fp.tokens are t_j of rows j, hidden [N, H] their
    h_{j-1}; writes its rows (and a KDA layer's state, tapped at the pass's taps as every
    layer's) and returns its streams after the layer [N, hc, H]. Device tensors only: a pass
    the graph runner captures captures it too."""
    cfg, m = model.cfg, model.weights.mtp
    if m is None or cfg.mtp_layer is None:
        raise ValueError("glm5_next: this checkpoint has no MTP layer loaded")
    eps = cfg.rms_norm_eps
    # an image row reads the image's embedding, as the trunk's (vLLM's and SGLang's MTP the same)
    embedded = fp.place_embeds(m.embed.index_select(0, fp.tokens))  # [N, H]
    joint = torch.cat([rms_norm(embedded, m.enorm, eps), rms_norm(hidden, m.hnorm, eps)], dim=-1)
    x = linear(joint, m.eh_proj)  # [N, H]
    streams = x[:, None, :].expand(-1, cfg.hc_mult, -1).contiguous()
    return decoder_layers(cfg, [(f"L{cfg.mtp_layer}", m.layer)], streams, fp, rows, slots)


def mtp_forward(
    model: GlmModel,
    fp: ForwardPass,
    rows: "PagedRows",
    slots: "StreamSlots",
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of MTP rows (`mtp_rows`). Returns (logits [R, V] fp32 of fp.logit_rows, the
    MTP's own hidden of every row [N, H])."""
    streams = mtp_rows(model, fp, rows, slots, hidden)
    m = model.weights.mtp
    assert m is not None
    own = mhc.head_of_rows(streams, torch.arange(fp.num_rows, device=streams.device))
    normed = rms_norm(own.index_select(0, fp.logit_rows), m.norm, model.cfg.rms_norm_eps)
    return model.logits(normed, m.head), own


@torch.inference_mode()
def draft(
    model: GlmModel,
    rows: "PagedRows",
    slots: "StreamSlots",
    runs: Sequence[StreamRows],
    hidden: torch.Tensor,
    k: int,
) -> torch.Tensor:
    """k greedy drafts a stream [S, k] int64 (see the module docstring); hidden [N - S, H] the
    h_{j-1} of the runs' rows but each run's last, in the runs' order."""
    if k < 1:
        raise ValueError(f"draft needs k >= 1, got {k}")
    if model.carry is None:
        raise ValueError("glm5_next: this checkpoint has no MTP layer loaded")
    page_rows = rows.page_rows
    runs = [replace(r, logits="last", taps=()) for r in runs]
    fp = ForwardPass(runs, page_rows, model.device)
    slot_ids = torch.tensor([r.slot for r in runs], device=hidden.device)
    carried = slots.get(model.carry).index_select(0, slot_ids)  # [S, H]
    pieces, at = [], 0
    for i, r in enumerate(runs):
        pieces += [hidden[at : at + len(r.tokens) - 1], carried[i : i + 1]]
        at += len(r.tokens) - 1
    if at != hidden.shape[0]:
        raise ValueError(f"draft: hidden has {hidden.shape[0]} rows, the runs need {at}")
    logits, own = mtp_forward(model, fp, rows, slots, torch.cat(pieces))
    token = logits.argmax(-1)  # [S]
    drafts = [token]
    if k > 1:
        kept = fixed_state(model, slots, [r.slot for r in runs])
        last = torch.tensor([hi - 1 for _, hi in fp.spans], device=own.device)
        own = own.index_select(0, last)
        for step in range(1, k):
            one = [StreamRows(r.slot, r.end + step - 1, [0], r.pages) for r in runs]
            fp = ForwardPass(one, page_rows, model.device)
            fp.tokens = token  # the previous drafts, still on the device
            logits, own = mtp_forward(model, fp, rows, slots, own)
            token = logits.argmax(-1)
            drafts.append(token)
        for (name, slot), state in kept.items():
            slots.get(name)[slot].copy_(state)
    return torch.stack(drafts, dim=1)


def fixed_state(
    model: GlmModel, slots: "StreamSlots", held: Sequence[int]
) -> dict[tuple[str, int], torch.Tensor]:
    """A copy of a KDA MTP layer's fixed state in slots `held` (empty for an MLA one), by
    (name, slot): what a draft puts back."""
    prefix = f"L{model.cfg.mtp_layer}."
    names = [
        s.name for s in model.layout.fixed if s.name.startswith(prefix) and s.name != model.carry
    ]
    return {(n, slot): slots.get(n)[slot].clone() for n in names for slot in held}


@torch.inference_mode()
def target_pass(
    model: GlmModel, rows: "PagedRows", slots: "StreamSlots", streams: Sequence[StreamRows]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A target pass that also hands back what each row's MTP row reads (tests, tools): (each
    stream's logits as ForwardPass.split_logits gives them, hidden [N, H])."""
    fp = ForwardPass(streams, rows.page_rows, model.device)
    hidden = torch.empty(fp.num_rows, model.cfg.hidden_size, dtype=model.dtype, device=model.device)
    return fp.split_logits(model.forward(fp, rows, slots, hidden=hidden)), hidden
