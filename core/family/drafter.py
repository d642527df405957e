"""A family's own drafter (`--draft model` or `--draft mtp`, the `model_drafter` hook): the
interface between it and the lanes. Cheap to import: no torch.

Once a round, after the draws and after a verify round's rewind, the lanes ask the drafter for
each drafting stream's next drafts (`ModelDrafter.propose`). A stream is then at position `pos`:
rows [0, pos) are in its pages and fixed state, and `token` (drawn from the last pass's logit
row `row`) is its next row's token, not yet fed. What the drafter proposes only proposes: the
verify round samples every row as plain decoding would, so the drafts change no token, only how
many a pass yields (docs/architecture.md, "Drafts and verify rounds")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class DraftAsk:
    """One stream's ask: its slot, page table (covering rows [0, pos), and as far as the
    drafts the stream may feed next round reach: rows a drafter may write, which the next pass
    rewrites or which lie past the stream's kept rows), position, next token, and the index of
    the last pass's logit row its token was drawn from (the row whose hidden state a drafter
    that reads the target's reads)."""

    slot: int
    pages: Sequence[int]
    pos: int
    token: int
    row: int


class ModelDrafter(Protocol):
    """What the `model_drafter` hook returns."""

    def propose(self, asks: Sequence[DraftAsk], k: int) -> list[list[int]]:
        """Up to k draft tokens for each ask, in order. Read the target's storage; write only
        rows at or past each ask's pos, inside its pages, and leave every slot's fixed state
        as it was (the target's own MTP layer writes its draft rows there)."""
        ...
