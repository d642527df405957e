"""glm5_next's drafter for `--draft mtp` (the model_drafter hook, folder None): the checkpoint's
own MTP layer (mtp.py), asked once a round by the lanes for each drafting stream's next drafts
(tensorfold.family.drafter).

Opening it turns the trunk's MTP rows on (`GlmModel.mtp_rows`): from then on every pass, prompt
chunks and decode and verify rows alike, runs the MTP's rows for its rows right after the
trunk's, inside the same forward (and the same CUDA graph), so the MTP's paged rows and a KDA
MTP layer's state follow each stream, and its carry (`L{N}.carry`, the trunk's h of the last
row fed) is tapped, rewound, kept and restored like any fixed state. A resumed prompt, a
rewound verify round and a forked choice (n > 1) leave it where the target is.

An ask at position pos (rows [0, pos) fed, its next token x = t_pos not yet): step 1 runs the
MTP's row pos, (carry = h_{pos-1}, x), whose logits' argmax is draft 1 (t_{pos+1}); step j + 1
runs row pos + j from the MTP's own hidden g of row pos + j - 1 and draft j (as mtp.draft). All
asks step together, one pass a step. The drafter writes the MTP's rows pos .. pos + k - 1 only:
the next pass feeds x at pos and its drafts after it, and its MTP rows rewrite every row it
keeps; rows past those are past the stream's kept rows, rewritten before any pass reads them.
It puts a KDA MTP layer's state of the asked slots back as it found it (the next pass runs row
pos again), and never touches the carry. Each ask drafts as far as its pages reach (the lanes
hand pages covering the drafts the stream may feed, `DraftAsk.pages`). Greedy: argmax, the
first index on ties."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from tensorfold.family.checkpoint import CheckpointError
from tensorfold.family.drafter import DraftAsk
from tensorfold.family.forward_pass import ForwardPass, StreamRows

from .mtp import fixed_state, mtp_forward

if TYPE_CHECKING:
    from .model import GlmModel


class MtpDrafter:
    """A ModelDrafter over the target's own MTP layer and its storage."""

    def __init__(self, model: "GlmModel", runner: Any) -> None:
        self.model, self.runner = model, runner

    @torch.inference_mode()
    def propose(self, asks: Sequence[DraftAsk], k: int) -> list[list[int]]:
        model, rows, slots = self.model, self.runner.rows, self.runner.slots
        assert model.carry is not None
        page_rows = rows.page_rows
        steps = [max(0, min(k, len(a.pages) * page_rows - a.pos)) for a in asks]
        live = [i for i, n in enumerate(steps) if n > 0]
        drafts: list[list[int]] = [[] for _ in asks]
        if not live:
            return drafts
        device = model.device
        held = [asks[i].slot for i in live]
        kept = fixed_state(model, slots, held)
        slot_ids = torch.tensor(held, dtype=torch.long, device=device)
        hidden = slots.get(model.carry).index_select(0, slot_ids)  # [S, H]: h_{pos-1}
        tokens = torch.tensor([asks[i].token for i in live], dtype=torch.long, device=device)
        out = []  # per step: (the asks stepping, their drafts on the device)
        for step in range(max(steps)):
            going = [j for j, i in enumerate(live) if steps[i] > step]
            if len(going) < len(live):  # some asks' pages end here: the others go on
                keep = torch.tensor(going, dtype=torch.long, device=device)
                hidden, tokens = hidden.index_select(0, keep), tokens.index_select(0, keep)
                live = [live[j] for j in going]
            runs = [StreamRows(asks[i].slot, asks[i].pos + step, [0], asks[i].pages) for i in live]
            fp = ForwardPass(runs, page_rows, device)
            fp.tokens = tokens
            logits, hidden = mtp_forward(model, fp, rows, slots, hidden)
            tokens = logits.argmax(-1)
            out.append((live, tokens))
        for (name, slot), state in kept.items():
            slots.get(name)[slot].copy_(state)
        picked = iter(torch.cat([t for _, t in out]).tolist())  # one read for every step
        for stepping, _ in out:
            for i in stepping:
                drafts[i].append(next(picked))
        return drafts


def open_drafter(model: "GlmModel", runner: Any) -> MtpDrafter:
    """The model_drafter hook's answer for `--draft mtp`: the MTP layer loaded with the target
    (tensorfold_glm.config.mtp_served), its rows run from now on by every pass."""
    if model.weights.mtp is None or model.carry is None:
        raise CheckpointError(
            "glm5_next: no MTP layer was loaded (config.json declares none, its weights are "
            "not in the checkpoint, or the weights are dummy ones)"
        )
    model.mtp_rows = True
    return MtpDrafter(model, runner)
