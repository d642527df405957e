"""Gemma 4's sliding layers on per-stream rings instead of pages.

A sliding layer that owns its K/V keeps only the rows its window reads: a ring of a stream's last
W-1 rows, fixed state `L{i}.sk` / `L{i}.sv` [W-1, kv_heads, head_dim] in the model's dtype (one
rank's KV heads under tensor parallel: shards.ring_specs), indexed by absolute position mod W-1
(core/ops/window_attention.py). The prompt store snapshots the rings at marks, tapped inside the
pass that computes them, so a kept prompt holds the last W-1 sliding rows it needs to resume.
A verify run (StreamRows.rewind) taps less: the ring rows its advance overwrites, saved before
it, which put back rewind the rings to any draft row (RingRewinds; on the GPU path a uniform
verify pass's by row from the device meta, as a CUDA graph replays it: ring_taps.py).

Under TF_KV_DTYPE=fp8 the rings are e4m3 with their scales beside them (`L{i}.sk.scale`,
[W-1, kv_heads, 1]): the pass's new rows are quantized before attention reads them, so a row
reads the same new in its pass as kept in the ring later (resumed == fresh).

Image blocks (config `use_bidirectional_attention: "vision"`): a row inside an image's rows sees
every row of that image, later ones too, within its window's past bound (`upto`, the pass's
attend_upto); the lanes run an image's rows in one pass, so they are all among its new rows.

Attention reads a layer's rings as they stood before the pass, plus the pass's new rows, then the
rings advance. A store layer whose rows later reuse layers read (KV sharing) keeps its new rows
and defers its advance until the last of its readers has attended, so every reader sees the same
rings and rows the store layer saw. The same order on the CPU (torch) and GPU (Triton) paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.family.forward_pass import ForwardPass
from tensorfold.memory.kv_dtype import SCALE
from tensorfold.ops.gpu import use_triton
from tensorfold.ops.kv_quant import quantize
from tensorfold.ops.window_attention import (
    RingRewinds,
    RingScales,
    advance_many,
    gather_window,
    ring_after,
    ring_attention,
)

from .config import Layer
from .ring_taps import save_ring_rows

if TYPE_CHECKING:
    from tensorfold.adapters.stream_state import StreamSlots


class SlidingRows:
    """One pass's sliding layers. `shared`: the store layers whose rows a later reuse layer reads;
    their new rows [N, kv_heads, head_dim] are held and their rings advance after the last
    reader (`pending`). `blocks`: image rows attend to their whole image (fp.attend_upto)."""

    def __init__(
        self,
        fp: ForwardPass,
        slots: "StreamSlots",
        shared: frozenset[int],
        blocks: bool = False,
    ):
        self.fp = fp
        self.slots = slots
        self.shared = shared
        self.upto = fp.attend_upto if blocks else None
        self.pending: dict[int, tuple[torch.Tensor, ...]] = {}
        self.last_reader: dict[int, int] | None = None
        self.rewinds: dict[int, RingRewinds] = {}  # by ring length: the pass's rewind runs

    def attend(
        self,
        layers: Sequence[Layer],
        layer: Layer,
        q: torch.Tensor,
        new: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        scale: float,
    ) -> torch.Tensor:
        """q [N, Hq, D]; new: the layer's K and V rows [N, kv_heads, D] when it owns them, None
        for a reuse layer (it reads its store layer's). layers: the model's layers (to know each
        store layer's last reader). Returns [N, Hq, D]: attention over the window, rings before
        the pass plus the pass's rows; then moves the rings on past the pass (taps first)."""
        assert layer.window is not None
        src = layer.kv_source
        names = [f"L{src}.sk", f"L{src}.sv"]
        fp8 = f"L{src}.sk{SCALE}" in self.slots.buffers
        if fp8:
            names += [f"L{src}.sk{SCALE}", f"L{src}.sv{SCALE}"]
        rings = [self.slots.get(name) for name in names]  # ring_k, ring_v(, their scales)
        if new is None:
            rows = self.pending[src]
        elif fp8:  # (k, v, k scales, v scales)
            (k, ks), (v, vs) = quantize(new[0], new[1])  # one launch on the GPU
            rows = (k, v, ks, vs)
        else:
            rows = new
        scales = RingScales(rows[2], rows[3], rings[2], rings[3]) if fp8 else None
        out = ring_attention(
            q,
            rows[0],
            rows[1],
            rings[0],
            rings[1],
            self.fp,
            scale=scale,
            window=layer.window,
            scales=scales,
            upto=self.upto,
        )
        if new is not None:
            self._tap(names, rings, rows, layer.window)
            if src in self.shared:
                self.pending[src] = rows
                return out
        elif layer.index != self._last_readers(layers)[src]:
            return out
        else:
            del self.pending[src]
        advance_many(rings, list(rows), self.fp)  # K, V (and their scales): one launch
        return out

    def _last_readers(self, layers: Sequence[Layer]) -> dict[int, int]:
        if self.last_reader is None:
            self.last_reader = {}
            for other in layers:
                if other.reuses_kv:
                    self.last_reader[other.kv_source] = other.index
        return self.last_reader

    def _tap(
        self,
        names: list[str],
        rings: list[torch.Tensor],
        rows: tuple[torch.Tensor, ...],
        window: int,
    ) -> None:
        """The rings (names[i]: rings[i], before the pass, to be advanced by rows[i]) as they
        stand after row p - 1, at each tap p of the pass's runs (in an eager pass, whose
        streams are real, so a host loop is fine). A rewind run's taps are the
        ring rows its advance will overwrite, saved now (RingRewinds): called before the
        advance, deferred or not, of the layer that owns the rings. A uniform verify pass on
        the GPU path (fp.rows_each: maybe a CUDA graph's, its host streams placeholders) taps
        by row from the device meta alone (ring_taps.py)."""
        fp = self.fp
        if fp.rows_each and use_triton(rows[0]):
            for name, ring, new in zip(names, rings, rows):
                fp.tap_rows(name, save_ring_rows(ring, new, fp))
            return
        if not any(stream.taps for stream in fp.streams):
            return
        length = rings[0].shape[1]
        if length not in self.rewinds:
            self.rewinds[length] = RingRewinds(fp, length)
        rewinds = self.rewinds[length]
        for name, ring in zip(names, rings):
            for (i, p), restore in rewinds.save(ring).items():
                fp.tap(i, p, name, restore)
        saved = set(rewinds.streams)
        whole = [i for i, stream in enumerate(fp.streams) if stream.taps and i not in saved]
        if not whole:
            return
        for pair in range(0, len(names), 2):  # (K, V), then (K scales, V scales)
            got = gather_window(
                rings[pair], rings[pair + 1], rows[pair], rows[pair + 1], fp, window
            )
            for i in whole:
                for p in fp.streams[i].taps:
                    for name, gathered in (
                        (names[pair], got.keys[i]),
                        (names[pair + 1], got.values[i]),
                    ):
                        fp.tap(i, p, name, ring_after(gathered, got.bases[i], p, window))
