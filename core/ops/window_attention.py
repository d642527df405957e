"""Sliding-window attention over per-stream rings of rows (torch reference, the CPU path).

A sliding layer with window W needs only a stream's last W-1 rows, so it keeps them as fixed
state: a ring [W-1, Hkv, D] per stream, row p at index p mod (W-1). A run over [s, e) reads the
ring's rows of positions [max(0, s-W+1), s), then its own new rows. The ring's other rows (stale
rows of older positions, NaN once a freed slot is poisoned) are never gathered: the rows a run
attends to start from zeros and are filled with valid rows only, since a masked row times 0 is
still NaN.

Exactness as in core/ops/attention.py: key tiles of KEY_TILE aligned to absolute positions,
zero-padded query blocks of QUERY_BLOCK and the same online softmax, so a row's result depends
only on its position and its stream's rows, however the pass is cut and whatever shares it; the
bits are paged_attention's over the same rows.

`ring_attention` and `advance_rings` (`advance_many`: several rings at once) are the pass-level
entry points: on the GPU they run the Triton kernels of triton_window.py (layout from PassMeta,
no host sync, graph-capturable), on the CPU the torch reference below. Attention reads the
rings before they advance.

fp8 rings (TF_KV_DTYPE=fp8): the rings and the pass's new rows are e4m3 with their scales
(`RingScales`, tensorfold.ops.kv_quant), so a row reads the same whether it is new in the pass
or kept in the ring; the reference dequantizes the gathered rows, the kernel folds the scales in
after the sums (as paged attention does).

Media blocks (Gemma 4's images, forward_pass.StreamRows.blocks): with `upto` (the pass's
`attend_upto`) a query at t sees keys t-window < j <= upto[t], so a row inside a block also sees
the block's later rows (its run holds them all). The key tiles a query block walks reach its
rows' largest upto; a tile a row cannot see is an exact no-op for it, as ever, so a row's bits
still depend only on its position, its upto and its stream's rows.

Taps: `ring_after` builds a whole ring as it stood mid-pass (prompt-store marks). A `rewind` run
(a verify round's, forward_pass.StreamRows) needs less: `RingRewinds.save` keeps, before the
advance, the ring rows the run will overwrite, and each tap puts back those at and past it
(`SavedRingRows`, a forward_pass.SlotRestore): a row a draft instead of a ring a draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from ..family.forward_pass import ForwardPass
from .attention import KEY_TILE, QUERY_BLOCK, rows_dot, weighted_rows
from .gpu import use_triton
from .kv_quant import FP8_DTYPE, index_copy_rows


class RingScales(NamedTuple):
    """The fp8 scales beside a sliding layer's rows: new_k, new_v [N, Hkv, 1] (the pass's
    rows), ring_k, ring_v [slots, W-1, Hkv, 1] (the rings before the pass)."""

    new_k: torch.Tensor
    new_v: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor


@dataclass
class WindowRows:
    """One layer's rows for each stream of a pass: stream i's at positions [bases[i], end_i),
    bases aligned to KEY_TILE; rows below its run's window are zeros."""

    bases: list[int]
    keys: list[torch.Tensor]  # [T_i, Hkv, D]
    values: list[torch.Tensor]  # [T_i, Hkv, Dv]


def gather_window(
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    fp: ForwardPass,
    window: int,
) -> WindowRows:
    """ring_k [slots, W-1, Hkv, D], ring_v [slots, W-1, Hkv, Dv]: the rings before the pass;
    new_k [N, Hkv, D], new_v [N, Hkv, Dv]: the pass's rows. A run from 0 reads no ring row."""
    rows = ring_k.shape[1]
    out = WindowRows([], [], [])
    for s, (a, b) in zip(fp.streams, fp.spans):
        lo = max(0, s.start - window + 1)
        base = lo // KEY_TILE * KEY_TILE
        old = torch.arange(lo, s.start, device=fp.device) % max(rows, 1)
        out.bases.append(base)
        for ring, new, into in ((ring_k, new_k, out.keys), (ring_v, new_v, out.values)):
            zeros = new.new_zeros(lo - base, *new.shape[1:])
            into.append(torch.cat([zeros, ring[s.slot].index_select(0, old), new[a:b]]))
    return out


def ring_attention(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    fp: ForwardPass,
    *,
    scale: float,
    window: int,
    scales: RingScales | None = None,
    upto: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; new_k [N, Hkv, D], new_v [N, Hkv, Dv]: the pass's rows; ring_k
    [slots, W-1, Hkv, D], ring_v [slots, W-1, Hkv, Dv]: the rings before the pass; scales:
    theirs when all four are fp8. A query at t sees keys t-window < j <= t of its stream, or
    with upto [N] (fp.attend_upto: t, or inside a media block the block's last row) keys
    t-window < j <= upto[t]. Returns [N, Hq, Dv] in q's dtype."""
    if use_triton(q):
        from .pass_meta import pass_meta
        from .triton_window import ring_attention as triton_ring_attention

        return triton_ring_attention(
            q,
            new_k,
            new_v,
            ring_k,
            ring_v,
            fp.positions,
            pass_meta(fp),
            scale=scale,
            window=window,
            scales=scales,
            upto=upto,
            reach=block_reach(fp) if upto is not None else 0,
        )
    rows = gather_window(ring_k, ring_v, new_k, new_v, fp, window)
    if scales is not None:  # the gathered rows dequantized, the zero padding staying zero
        s = gather_window(scales.ring_k, scales.ring_v, scales.new_k, scales.new_v, fp, window)
        rows = WindowRows(
            rows.bases,
            [k.float() * ks for k, ks in zip(rows.keys, s.keys)],
            [v.float() * vs for v, vs in zip(rows.values, s.values)],
        )
    return window_attention(q, rows, fp, scale=scale, window=window, upto=upto)


def block_reach(fp: ForwardPass) -> int:
    """How far past its own position a row of the pass may see (upto - position): the longest
    rest of a media block after a row of it, from the streams' blocks on the host (no sync)."""
    reach = 0
    for s in fp.streams:
        for a, b in s.blocks:
            reach = max(reach, b - 1 - max(a, s.start))
    return reach


def advance_rings(ring: torch.Tensor, new: torch.Tensor, fp: ForwardPass) -> None:
    """ring [slots, W-1, ...]; new [N, ...]: the pass's rows. Each stream's ring then holds its
    last W-1 rows up to its run's end."""
    rows = ring.shape[1]
    if rows == 0:
        return
    if use_triton(new):
        from .pass_meta import pass_meta
        from .triton_window import advance_rings as triton_advance_rings

        triton_advance_rings(ring, new, fp.positions, pass_meta(fp))
        return
    for s, (a, b) in zip(fp.streams, fp.spans):
        first = max(s.start, s.end - rows)
        index = torch.arange(first, s.end, device=fp.device) % rows
        index_copy_rows(ring[s.slot], index, new[a + first - s.start : b])


def advance_many(rings: list[torch.Tensor], news: list[torch.Tensor], fp: ForwardPass) -> None:
    """advance_rings(ring, new, fp) of each pair: a sliding layer's K and V rings (and their fp8
    scales), on the GPU in one launch."""
    if news and use_triton(news[0]):
        from .pass_meta import pass_meta
        from .triton_window import advance_many as triton_advance_many

        triton_advance_many(list(rings), list(news), fp.positions, pass_meta(fp))
        return
    for ring, new in zip(rings, news):
        advance_rings(ring, new, fp)


@dataclass
class SavedRingRows:
    """Rows of one stream's ring as they stood before a pass advanced it (a rewind run's tap,
    forward_pass.SlotRestore): `restore_into(ring)` [W-1, ...] writes them back."""

    index: torch.Tensor  # [n] ring rows
    rows: torch.Tensor  # [n, ...]: their contents before the pass

    def restore_into(self, slot_state: torch.Tensor) -> None:
        index_copy_rows(slot_state, self.index, self.rows)


class RingRewinds:
    """What a pass's rewind runs (forward_pass.StreamRows.rewind) need of rings [slots, W-1, ...]
    (W-1 = `rows`) to rewind to any of their taps: the ring rows of positions from their first
    tap to their end, the rows their advance overwrites. `streams`: the indices in the pass of
    the rewind runs with taps no longer than a ring (in a longer one two positions share a
    ring row: its taps take whole rings, `ring_after`). Built once a pass and ring length."""

    def __init__(self, fp: ForwardPass, rows: int):
        self.streams: list[int] = []
        self._cuts: list[tuple[int, int, int, Sequence[int]]] = []  # (at, first, end, taps)
        flat: list[int] = []  # slot * rows + ring row, in the rings viewed [slots * rows, ...]
        for i, s in enumerate(fp.streams):
            if s.rewind and s.taps and len(s.tokens) <= rows:
                first = min(s.taps)
                self.streams.append(i)
                self._cuts.append((len(flat), first, s.end, s.taps))
                flat.extend(s.slot * rows + p % rows for p in range(first, s.end))
        self._flat = torch.tensor(flat, dtype=torch.long, device=fp.device)
        self._index = self._flat % max(rows, 1)  # the ring row within a slot

    def save(self, ring: torch.Tensor) -> dict[tuple[int, int], SavedRingRows]:
        """ring [slots, W-1, ...], before the pass advances it -> {(stream index, tap p): the
        rows of positions [p, end) as they stand now}: put back into the ring the pass leaves,
        they leave it as it stood after row p - 1 (the run's rows before p lie elsewhere)."""
        if not self.streams:
            return {}
        rows = ring.flatten(0, 1)
        if rows.dtype == FP8_DTYPE:  # no index_select for e4m3: the same bytes
            saved = rows.view(torch.uint8).index_select(0, self._flat).view(FP8_DTYPE)
        else:
            saved = rows.index_select(0, self._flat)
        out = {}
        for i, (at, first, end, taps) in zip(self.streams, self._cuts):
            for p in taps:
                cut = slice(at + p - first, at + end - first)
                out[(i, p)] = SavedRingRows(self._index[cut], saved[cut])
        return out


def ring_after(rows: torch.Tensor, base: int, p: int, window: int) -> torch.Tensor:
    """A stream's ring as it stands after row p - 1 (zeros where no row is valid), from its
    gathered rows [T, ...] at positions [base, base + T) -> [W-1, ...]. p must lie in its run."""
    ring = rows.new_zeros(window - 1, *rows.shape[1:])
    lo = max(0, p - window + 1)
    if p > lo:
        index = torch.arange(lo, p, device=rows.device) % (window - 1)
        index_copy_rows(ring, index, rows[lo - base : p - base])
    return ring


def window_attention(
    q: torch.Tensor,
    kv: WindowRows,
    fp: ForwardPass,
    *,
    scale: float,
    window: int,
    upto: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]: the pass's queries; a query at t sees keys t-window < j <= t of its stream
    (upto [N]: t-window < j <= upto[t]). Returns [N, Hq, Dv] in q's dtype, computed in fp32."""
    out = q.new_empty(q.shape[0], q.shape[1], kv.values[0].shape[-1])
    last = fp.positions if upto is None else upto
    for i, (a, b) in enumerate(fp.spans):
        keys, values = (_tiled(x[i]) for x in (kv.keys, kv.values))
        qs, positions, ups = q[a:b].float(), fp.positions[a:b], last[a:b]
        for qa in range(0, b - a, QUERY_BLOCK):
            qb, pos = qs[qa : qa + QUERY_BLOCK], positions[qa : qa + QUERY_BLOCK]
            up = ups[qa : qa + QUERY_BLOCK]
            m = qb.shape[0]
            if m < QUERY_BLOCK:  # padded queries repeat the last row; their rows are dropped
                qb = F.pad(qb, (0, 0, 0, 0, 0, QUERY_BLOCK - m))
                pos = torch.cat([pos, pos[-1:].expand(QUERY_BLOCK - m)])
                up = torch.cat([up, up[-1:].expand(QUERY_BLOCK - m)])
            o = _block(qb, pos, up, keys, values, kv.bases[i], scale, window)
            out[a + qa : a + qa + m] = o[:m]
    return out


def _tiled(rows: torch.Tensor) -> torch.Tensor:
    """rows [T, Hkv, D] -> [Hkv, T*, D] fp32, zero-padded to whole key tiles."""
    return F.pad(rows.float(), (0, 0, 0, 0, 0, (-rows.shape[0]) % KEY_TILE)).transpose(0, 1)


def _block(qb, pos, up, keys, values, base, scale, window):
    """One query block [Bq, Hq, D] at positions pos [Bq], each seeing keys up to up [Bq], against
    the key tiles it can see; keys [Hkv, T*, D] and values [Hkv, T*, Dv] start at absolute
    position `base`."""
    hkv, bq = keys.shape[0], qb.shape[0]
    group = qb.shape[1] // hkv
    # [Bq, Hkv*G, D] -> [Hkv, G*Bq, D]: query head h reads KV head h // G.
    qh = qb.view(bq, hkv, group, -1).permute(1, 2, 0, 3).reshape(hkv, group * bq, -1)
    qpos, qup = pos.repeat(group), up.repeat(group)  # [G*Bq], matching qh's rows
    lo = max(0, int(pos.min()) - window + 1) // KEY_TILE * KEY_TILE
    hi = int(up.max()) + 1
    dev = qb.device
    run_max = torch.full((hkv, group * bq, 1), float("-inf"), device=dev)
    run_sum = torch.zeros(hkv, group * bq, 1, device=dev)
    acc = torch.zeros(hkv, group * bq, values.shape[-1], device=dev)
    for t0 in range(lo, hi, KEY_TILE):
        kpos = torch.arange(t0, t0 + KEY_TILE, device=dev)
        visible = (kpos[None, :] <= qup[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        tile = slice(t0 - base, t0 - base + KEY_TILE)
        s = rows_dot(qh, keys[:, tile]) * scale
        s = s.masked_fill(~visible, float("-inf"))
        new_max = torch.maximum(run_max, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe)
        alpha = torch.exp(run_max - safe)
        run_sum = run_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + weighted_rows(p, values[:, tile])
        run_max = new_max
    o = acc / run_sum  # [Hkv, G*Bq, Dv]
    return o.view(hkv, group, bq, -1).permute(2, 0, 1, 3).reshape(bq, hkv * group, -1)
