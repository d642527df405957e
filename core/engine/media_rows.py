"""A stream's media pieces on its lane: checked at submit, their embeddings computed once and
sliced into the prompt chunks that hold their rows, and where a chunk may end around blocks.

A piece's embeddings are computed (`ModelRunner.encode_media`) when the first chunk holding one
of its rows is planned, in one call for every piece that chunk needs, and dropped once its rows
are computed; a piece wholly inside a store hit is never computed. A block (MediaPiece.block) is
computed whole in one chunk: a chunk ends only at a clean cut (`clean_cut`), and no state is
kept strictly inside a block (`MediaRows.outside`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..family.media import MediaPiece
from .requests import RequestRefused

Encode = Callable[[Sequence[MediaPiece]], list[torch.Tensor]]


def check_media(
    media: Sequence[MediaPiece], prompt_len: int, pass_rows: int, family: str | None
) -> None:
    """Refuse pieces a prompt cannot hold: media for a family without a tower (`family` is then
    its name, else None), pieces outside the prompt, out of order or overlapping, a block
    longer than a pass. `param` "messages": the images came in the chat's messages."""
    if not media:
        return
    if family is not None:
        raise RequestRefused(f"the {family} family takes no images", "messages")
    last = 0
    for i, m in enumerate(media):
        if m.rows < 1 or m.start < last or m.end > prompt_len:
            where = "outside the prompt" if m.end > prompt_len or m.start < 0 else "overlapping"
            raise RequestRefused(
                f"media piece {i} fills rows [{m.start}, {m.end}), {where}: pieces lie in "
                f"prompt order inside the prompt's {prompt_len} rows, one after another",
                "messages",
            )
        if m.block and m.rows > pass_rows:
            raise RequestRefused(
                f"media piece {i} is a block of {m.rows} rows, computed in one pass, and a pass "
                f"holds {pass_rows}; send a smaller image",
                "messages",
            )
        last = m.end


def clean_cut(pos: int, end: int, n: int, cut_rows: int, blocks: Sequence[tuple[int, int]]) -> int:
    """Where a prompt chunk from `pos` that would end at `end` ends: the last clean cut in
    (pos, end], else the first past it. A cut c is clean when it is a multiple of the family's
    `cut_rows` or the prompt's end `n`, and not strictly inside a block [a, b): so a block is
    computed in one chunk, and where a chunk ends depends on the prompt and `end` alone."""

    def inside(c: int) -> tuple[int, int] | None:
        return next(((a, b) for a, b in blocks if a < c < b), None)

    c = end
    while c > pos:  # down: strictly decreasing, to a block's start or a multiple of cut_rows
        block = inside(c)
        if block is not None:
            c = block[0]
        elif c % cut_rows and c != n:
            c -= c % cut_rows
        else:
            return c
    c = max(end, pos + 1)
    while True:  # up: strictly increasing, bounded by n (clean: pieces lie inside the prompt)
        block = inside(c)
        if block is not None:
            c = block[1]
        elif c % cut_rows and c != n:
            c = min(c + cut_rows - c % cut_rows, n)
        else:
            return c


class MediaRows:
    """One stream's pieces, in prompt order, and the embeddings computed for its prompt so far."""

    def __init__(self, pieces: Sequence[MediaPiece]):
        self.pieces = tuple(pieces)
        self.blocks = tuple((m.start, m.end) for m in self.pieces if m.block)
        self.held: dict[int, torch.Tensor] = {}  # piece index -> [rows, hidden]
        self.encoded = 0  # pieces computed, for the tests and the status page

    def outside(self, positions: Sequence[int]) -> list[int]:
        """`positions` less those strictly inside a block (no state is kept there)."""
        return [p for p in positions if not any(a < p < b for a, b in self.blocks)]

    def run_parts(
        self, pos: int, end: int, encode: Encode
    ) -> tuple[list[tuple[int, torch.Tensor]], list[tuple[int, int]]]:
        """The chunk [pos, end)'s media rows, as StreamRows' `embeds` and `blocks`; the pieces
        it needs that are not computed yet are, in one call of `encode`."""
        inside = [i for i, m in enumerate(self.pieces) if m.start < end and m.end > pos]
        wanted = [i for i in inside if i not in self.held]
        if wanted:
            values = encode([self.pieces[i] for i in wanted])
            self.encoded += len(wanted)
            for i, v in zip(wanted, values):
                self.held[i] = v
        embeds = []
        blocks = []
        for i in inside:
            m = self.pieces[i]
            a, b = max(m.start, pos), min(m.end, end)
            embeds.append((a, self.held[i][a - m.start : b - m.start]))
            if m.block:
                blocks.append((m.start, m.end))
        return embeds, blocks

    def computed(self, pos: int) -> None:
        """The prompt's rows before `pos` are computed: their pieces' embeddings go."""
        for i in [i for i in self.held if self.pieces[i].end <= pos]:
            del self.held[i]
