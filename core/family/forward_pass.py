"""One pass: the rows of several streams in one forward.

Each stream contributes a run of consecutive positions (a prompt chunk, or one decode row).
Rows reach their K/V through the stream's page table: row `pos` lives in page
`pages[pos // page_rows]` at offset `pos % page_rows`, i.e. flat row `page * page_rows + offset`
of a paged buffer viewed as [num_pages * page_rows, ...].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Sequence, runtime_checkable

import torch

LogitRows = Literal["last", "all", "none"]


@runtime_checkable
class SlotRestore(Protocol):
    """A tapped state in a cheaper form than a copy of it (the taps of a `rewind` run): what
    the pass changed in one slot buffer after the tap, to be put back. `restore_into(state)`
    takes `state`, the slot's buffer as the pass left it ([...] of one slot), back to the state
    at the tap; only the slot the tap's stream ran in, right after that pass, is a valid
    `state`."""

    def restore_into(self, slot_state: torch.Tensor) -> None: ...


# a fixed state tapped mid-pass: a copy of it, or (rewind runs only) how to get back to it
Tapped = torch.Tensor | SlotRestore


class PageOverrun(RuntimeError):
    """A pass would write rows past the pages a stream holds."""


@dataclass
class StreamRows:
    """One stream's rows in a pass.

    slot: the stream's lane slot (index of its fixed state).
    start: absolute position of the first row; rows [0, start) are already in the pages and
        fixed state. start == 0 means the stream's fixed state starts from zeros.
    tokens: the token ids of rows [start, start + len(tokens)).
    pages: the page table, covering at least rows [0, start + len(tokens)).
    logits: which rows want logits back.
    taps: positions p inside this run (start < p <= end) where the family records its fixed
        state as it stands after row p - 1, into ForwardPass.tapped (prompt-store marks: keeps
        add no pass).
    rewind: the taps are recorded only so the lanes can rewind a rejected draft
        (`ModelRunner.rewind_slot`, right after the pass), never kept by the prompt store: a
        family may record them as a `SlotRestore` instead of a copy of the state.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    pages: Sequence[int]
    logits: LogitRows = "last"
    taps: Sequence[int] = field(default_factory=tuple)
    rewind: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class ForwardPass:
    """The index tensors a family's forward needs for one pass (built once, on `device`)."""

    def __init__(
        self, streams: Sequence[StreamRows], page_rows: int, device: str | torch.device = "cpu"
    ):
        if not streams:
            raise ValueError("a pass needs at least one stream")
        self.streams = list(streams)
        self.page_rows = page_rows
        self.device = torch.device(device)
        spans: list[tuple[int, int]] = []
        tokens: list[int] = []
        positions: list[int] = []
        writes: list[int] = []
        logit_rows: list[int] = []
        row = 0
        for s in self.streams:
            if not s.tokens:
                raise ValueError(f"stream in slot {s.slot} has no rows in this pass")
            held = len(s.pages) * page_rows
            if s.end > held:
                raise PageOverrun(
                    f"slot {s.slot}: rows up to {s.end} need {-(-s.end // page_rows)} pages, "
                    f"the stream holds {len(s.pages)} ({held} rows)"
                )
            n = len(s.tokens)
            spans.append((row, row + n))
            tokens.extend(s.tokens)
            pos = list(range(s.start, s.end))
            positions.extend(pos)
            writes.extend(s.pages[p // page_rows] * page_rows + p % page_rows for p in pos)
            if s.logits == "all":
                logit_rows.extend(range(row, row + n))
            elif s.logits == "last":
                logit_rows.append(row + n - 1)
            row += n
        self.num_rows = row
        self.spans = spans
        as_long: dict[str, Any] = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.tensor(tokens, **as_long)  # [N]
        self.positions = torch.tensor(positions, **as_long)  # [N]
        self.write_index = torch.tensor(writes, **as_long)  # [N] flat rows in the paged buffers
        self.logit_rows = torch.tensor(logit_rows, **as_long)  # [R] rows of the pass
        self._reads: dict[int, torch.Tensor] = {}
        # (stream index, position) -> {fixed-state name: the state after row position - 1, or
        # for a rewind run a SlotRestore back to it}
        self.tapped: dict[tuple[int, int], dict[str, Tapped]] = {}

    def tap(self, i: int, pos: int, name: str, state: Tapped) -> None:
        self.tapped.setdefault((i, pos), {})[name] = state

    def read_index(self, i: int) -> torch.Tensor:
        """Flat rows [0, end) of stream i, in position order: [end]."""
        if i not in self._reads:
            s = self.streams[i]
            pos = torch.arange(s.end, device=self.device)
            table = torch.tensor(list(s.pages), dtype=torch.long, device=self.device)
            self._reads[i] = table[pos // self.page_rows] * self.page_rows + pos % self.page_rows
        return self._reads[i]

    def split_logits(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Cut [R, V] logits (in logit_rows order) back into one tensor per stream."""
        out, at = [], 0
        for s in self.streams:
            n = {"all": len(s.tokens), "last": 1, "none": 0}[s.logits]
            out.append(logits[at : at + n])
            at += n
        return out
