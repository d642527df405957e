"""A uniform verify pass's ring taps, by row and from the device meta alone (CUDA graphs).

A uniform verify pass (`ForwardPass.rows_each` = R: every stream a rewind run of R rows tapped
at each draft row) may be replayed from a CUDA graph, whose host-side streams are placeholders:
its taps are recorded with `fp.tap_rows`, from tensors the pass computes on the device. Before
the pass advances a ring [slots, L, ...] (L = W-1), `save_ring_rows` gathers, for each stream,
the ring rows of positions start + 1 .. start + R - 1 (those the advance overwrites, found from
PassMeta's stream_start and stream_slot) into a static [S, R-1, ...] tensor; `RingRowTaps.at(i,
j)` puts back rows j .. R-1 of stream i (`SavedRingRows`), which leaves the ring as plain
decoding leaves it after the stream's first j rows (window_attention.RingRewinds, by row).

A run longer than the ring (R > L: two of its positions on one ring row) also keeps the pass's
own rows [S, R, ...]: some rows of the state after row j were written in the pass and then
overwritten by a later row of it.
"""

from __future__ import annotations

import torch

from tensorfold.family.forward_pass import ForwardPass, Tapped
from tensorfold.ops.kv_quant import FP8_DTYPE
from tensorfold.ops.pass_meta import pass_meta
from tensorfold.ops.window_attention import SavedRingRows


def _select(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows.index_select(0, index), also for e4m3 (the same bytes)."""
    if rows.dtype == FP8_DTYPE:
        return rows.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)
    return rows.index_select(0, index)


class RingRowTaps:
    """One ring's taps at every draft row of a uniform verify pass (forward_pass.RowTaps).

    ring_rows: the ring's rows (index [S, R-1] on the device, of positions start + 1 ..
    start + R - 1); before [S, R-1, ...]: their contents before the pass; new [S, R, ...]: the
    pass's rows, kept only when R > ring length (else None)."""

    def __init__(
        self,
        fp: ForwardPass,
        length: int,
        ring_rows: torch.Tensor,
        before: torch.Tensor,
        new: torch.Tensor | None,
    ):
        self.fp = fp
        self.length = length
        self.ring_rows = ring_rows
        self.before = before
        self.new = new

    def at(self, i: int, j: int) -> Tapped:
        """Stream i's ring after its first j rows (1 <= j < R), as rows put back."""
        if self.length == 0 or self.new is None:
            # positions start + j .. end - 1 on distinct ring rows, none of them the pass's
            return SavedRingRows(self.ring_rows[i, j - 1 :], self.before[i, j - 1 :])
        # a ring shorter than the run: each row the pass wrote after row j - 1 gets the latest
        # position before start + j on it, from the ring before the pass or the pass's rows
        # (host ints are fine here: this runs after the pass, on its real streams)
        r, length = self.new.shape[1], self.length
        start = self.fp.streams[i].start
        end = start + r
        index, sources = [], []
        for p in range(max(start + j, end - length), end):
            q = p - length
            while q >= start + j:
                q -= length
            index.append(p % length)
            sources.append(r - 1 + q - start if q >= start else p - start - 1)
        pool = torch.cat([self._bytes(self.before[i]), self._bytes(self.new[i])])
        rows = pool.index_select(0, torch.tensor(sources, device=pool.device))
        if self.before.dtype == FP8_DTYPE:
            rows = rows.view(FP8_DTYPE)
        return SavedRingRows(torch.tensor(index, device=pool.device), rows)

    @staticmethod
    def _bytes(rows: torch.Tensor) -> torch.Tensor:
        return rows.view(torch.uint8) if rows.dtype == FP8_DTYPE else rows


def save_ring_rows(ring: torch.Tensor, new: torch.Tensor, fp: ForwardPass) -> RingRowTaps:
    """ring [slots, L, ...] before the pass advances it by new [N, ...] (N = S * R, the pass's
    rows): the RowTaps that rewind it to any draft row. No host sync and no host stream read:
    graph-capturable."""
    meta = pass_meta(fp)
    r = fp.rows_each
    assert r is not None, "a uniform verify pass"
    s, length = len(fp.streams), ring.shape[1]
    if length == 0:  # no ring: nothing to put back
        empty = ring.new_empty(s, r - 1, *ring.shape[2:])[:, :0]
        return RingRowTaps(
            fp, 0, torch.zeros(s, 0, dtype=torch.long, device=ring.device), empty, None
        )
    offsets = torch.arange(1, r, dtype=torch.long, device=ring.device)
    ring_rows = (meta.stream_start.long()[:, None] + offsets) % length  # [S, R-1]
    flat = meta.stream_slot.long()[:, None] * length + ring_rows
    before = _select(ring.flatten(0, 1), flat.view(-1)).view(s, r - 1, *ring.shape[2:])
    kept = None
    if r > length:
        kept = RingRowTaps._bytes(new).reshape(s, r, *new.shape[1:]).clone()
        if new.dtype == FP8_DTYPE:
            kept = kept.view(FP8_DTYPE)
    return RingRowTaps(fp, length, ring_rows, before, kept)
