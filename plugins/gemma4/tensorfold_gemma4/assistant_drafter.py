"""gemma4's draft model for `--draft model --draft-model DIR` (the model_drafter hook): a
`gemma-4-*-assistant` checkpoint (assistant.py) asked once a round by the lanes for each
drafting stream's next drafts (tensorfold.family.drafter). For an ask at position p: the
target's hidden state of the logit row its next token was drawn from (after the final norm, in
the pass the runner ran last: `Gemma4Model.pass_hidden(runner.last_pass)`, under CUDA graphs the
replayed graph's own output), the K/V of its store layers gathered from the pages and rings
(assistant_kv.py, after the lanes rewound a verify round), position p, k greedy steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.drafter import DraftAsk

from .assistant import Gemma4Assistant, load_assistant
from .assistant_kv import gather_shared_kv

if TYPE_CHECKING:
    from .model import Gemma4Model


class AssistantDrafter:
    """A ModelDrafter over an assistant checkpoint and its target's storage."""

    def __init__(self, assistant: Gemma4Assistant, model: "Gemma4Model", runner: Any) -> None:
        self.assistant, self.model, self.runner = assistant, model, runner

    def propose(self, asks: Sequence[DraftAsk], k: int) -> list[list[int]]:
        model, device = self.model, self.model.device
        last = self.runner.last_pass  # a GraphRunner's: the static pass it replayed
        hidden = model.pass_hidden(last) if last is not None else None
        if hidden is None or k <= 0 or not asks:
            return [[] for _ in asks]
        rows = torch.tensor([a.row for a in asks], dtype=torch.long, device=device)
        kv = gather_shared_kv(
            model, self.runner.rows, self.runner.slots, [(a.slot, a.pages, a.pos) for a in asks]
        )
        tokens = torch.tensor([a.token for a in asks], dtype=torch.long, device=device)
        positions = torch.tensor([a.pos for a in asks], dtype=torch.long, device=device)
        draft = self.assistant.draft(tokens, hidden.index_select(0, rows), positions, kv, k)
        return draft.tokens.tolist()


def open_drafter(model: "Gemma4Model", runner: Any, folder: Path) -> AssistantDrafter:
    """The model_drafter hook's answer: the assistant at `folder`, checked against `model`."""
    return AssistantDrafter(load_assistant(Checkpoint.open(folder), model), model, runner)
