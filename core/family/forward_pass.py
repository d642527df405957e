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


@runtime_checkable
class RowTaps(Protocol):
    """One fixed state's taps at every draft row of a uniform verify pass (`ForwardPass.
    rows_each`), recorded by the family into tensors the pass made (so a CUDA graph's replay
    refreshes them): `at(i, j)` is stream i's state after its first j rows (1 <= j < rows_each),
    a copy or a `SlotRestore`, valid right after the pass."""

    def at(self, i: int, j: int) -> Tapped: ...


@dataclass
class StackedTaps:
    """RowTaps as one tensor: states [S, rows_each - 1, *slot state], row j - 1 the state after
    stream i's first j rows."""

    states: torch.Tensor

    def at(self, i: int, j: int) -> Tapped:
        return self.states[i, j - 1]


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
    embeds: media rows of this run, as (absolute position of the first, rows [n, hidden]):
        embeddings that replace the placeholder tokens' own (`ForwardPass.place_embeds`).
    blocks: media blocks (MediaPiece.block) this run holds, as absolute [start, end): a row
        inside one may attend to every row of it (`ForwardPass.attend_upto`). A run holds a
        block whole, or the rest of one it starts inside.
    """

    slot: int
    start: int
    tokens: Sequence[int]
    pages: Sequence[int]
    logits: LogitRows = "last"
    taps: Sequence[int] = field(default_factory=tuple)
    rewind: bool = False
    embeds: Sequence[tuple[int, torch.Tensor]] = field(default_factory=tuple)
    blocks: Sequence[tuple[int, int]] = field(default_factory=tuple)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


def uniform_verify(streams: Sequence[StreamRows]) -> int | None:
    """R when every stream is a rewind run of R > 1 rows tapped at each row after its first (a
    verify pass whose layout is fixed by its stream count and R: one a CUDA graph can replay),
    else None."""
    r = len(streams[0].tokens)
    if r < 2:
        return None
    for s in streams:
        if not s.rewind or len(s.tokens) != r or list(s.taps) != list(range(s.start + 1, s.end)):
            return None
    return r


class ForwardPass:
    """The index tensors a family's forward needs for one pass (built once, on `device`).

    A uniform verify pass (`rows_each` = R, every stream a rewind run of R rows tapped at each
    draft row) is one the lanes may run as a CUDA graph (`tensorfold.engine.cuda_graphs`): a
    family that says so (`FamilyModel.verify_graphs`) runs it from the device meta alone
    (ops.pass_meta: no stream's slot, start, tokens or taps read on the host) and records its
    taps with `tap_rows`, never `tap`."""

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
        embed_rows: list[int] = []
        embed_values: list[torch.Tensor] = []
        upto: list[int] | None = None
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
            for at, values in s.embeds:
                if not (s.start <= at and at + values.shape[0] <= s.end):
                    raise ValueError(
                        f"slot {s.slot}: media rows [{at}, {at + values.shape[0]}) are not inside "
                        f"the run [{s.start}, {s.end})"
                    )
                embed_rows.extend(range(row + at - s.start, row + at - s.start + values.shape[0]))
                embed_values.append(values)
            if s.blocks or upto is not None:
                upto = upto if upto is not None else list(positions[:row])
                last = list(pos)
                for a, b in s.blocks:
                    if a < s.end and b > s.end:
                        raise ValueError(f"slot {s.slot}: block [{a}, {b}) ends past the run")
                    for p in range(max(a, s.start), b):
                        last[p - s.start] = b - 1
                upto.extend(last)
            row += n
        self.num_rows = row
        self.spans = spans
        as_long: dict[str, Any] = dict(dtype=torch.long, device=self.device)
        self.tokens = torch.tensor(tokens, **as_long)  # [N]
        self.positions = torch.tensor(positions, **as_long)  # [N]
        self.write_index = torch.tensor(writes, **as_long)  # [N] flat rows in the paged buffers
        self.logit_rows = torch.tensor(logit_rows, **as_long)  # [R] rows of the pass
        # media rows: [M] rows of the pass, and their embeddings [M, hidden]; None without media
        self.embed_rows: torch.Tensor | None = None
        self.embed_values: torch.Tensor | None = None
        if embed_rows:
            self.embed_rows = torch.tensor(embed_rows, **as_long)
            self.embed_values = torch.cat([v.to(self.device) for v in embed_values])
        # [N] the last position each row may attend to: its own, or inside a media block the
        # block's last; None when the pass holds no block (every row causal)
        self.attend_upto = None if upto is None else torch.tensor(upto, **as_long)
        self._reads: dict[int, torch.Tensor] = {}
        # (stream index, position) -> {fixed-state name: the state after row position - 1, or
        # for a rewind run a SlotRestore back to it}
        self.tapped: dict[tuple[int, int], dict[str, Tapped]] = {}
        self.rows_each = uniform_verify(self.streams)
        self.row_taps: dict[str, RowTaps] = {}  # fixed-state name -> its taps (rows_each only)
        # a GraphRunner's tap arena: fixed-state name -> [rows, *slot state], shared by its passes
        self.tap_arena: dict[str, torch.Tensor] | None = None
        self.tap_arena_rows = 0

    def place_embeds(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]: the pass's token embeddings, with the media rows' replaced by the
        pieces' (cast to x's dtype); x itself when the pass has none."""
        if self.embed_rows is None or self.embed_values is None:
            return x
        return x.index_copy(0, self.embed_rows, self.embed_values.to(x.dtype))

    def tap(self, i: int, pos: int, name: str, state: Tapped) -> None:
        self.tapped.setdefault((i, pos), {})[name] = state

    def tap_rows(self, name: str, taps: RowTaps) -> None:
        """A uniform verify pass's taps of one fixed state at every draft row (rows_each)."""
        self.row_taps[name] = taps

    def tap_space(self, name: str, slot_state: torch.Tensor) -> torch.Tensor:
        """Room for a uniform verify pass's taps of fixed state `name` by row: [streams,
        rows_each - 1, *state] in the state's dtype (`slot_state`: its slot buffer [slots,
        *state]). A view of the runner's tap arena when the pass has one (a GraphRunner's: one
        arena for every graph, as each pass's taps are read before the next pass runs, so a
        large state's taps are not held once a graph; made for a name on its first use, so
        only the states a family taps this way take room), else a new tensor."""
        r = self.rows_each
        assert r is not None, "taps by row are a uniform verify pass's"
        n, shape = len(self.streams) * (r - 1), slot_state.shape[1:]
        if self.tap_arena is None or n > self.tap_arena_rows:
            return slot_state.new_empty(len(self.streams), r - 1, *shape)
        arena = self.tap_arena.get(name)
        if arena is None:  # first asked for in a pass before any capture (GraphRunner._capture)
            arena = self.tap_arena[name] = slot_state.new_empty(self.tap_arena_rows, *shape)
        return arena[:n].view(len(self.streams), r - 1, *shape)

    def taps_at(self, i: int, pos: int) -> dict[str, Tapped] | None:
        """What the pass tapped of stream i at position `pos` (the state after row pos - 1),
        by position (`tap`) or by row (`tap_rows`); None where it tapped nothing."""
        if (i, pos) in self.tapped:
            return self.tapped[(i, pos)]
        j = pos - self.streams[i].start
        if self.row_taps and self.rows_each and 0 < j < self.rows_each:
            return {name: taps.at(i, j) for name, taps in self.row_taps.items()}
        return None

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
