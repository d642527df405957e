"""Gemma 4's sliding layers on per-stream rings instead of pages.

A sliding layer that owns its K/V keeps only the rows its window reads: a ring of a stream's last
W-1 rows, fixed state `L{i}.sk` / `L{i}.sv` [W-1, kv_heads, head_dim] in the model's dtype (one
rank's KV heads under tensor parallel: shards.ring_specs), indexed by absolute position mod W-1
(core/ops/window_attention.py). The prompt store snapshots the rings at marks, tapped inside the
pass that computes them, so a kept prompt holds the last W-1 sliding rows it needs to resume.

Attention reads a layer's rings as they stood before the pass, plus the pass's new rows, then the
rings advance. A store layer whose rows later reuse layers read (KV sharing) keeps its new rows
and defers its advance until the last of its readers has attended, so every reader sees the same
rings and rows the store layer saw. The same order on the CPU (torch) and GPU (Triton) paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.forward_pass import ForwardPass
from tensorfold.ops.window_attention import (
    advance_rings, gather_window, ring_after, ring_attention,
)

from .config import Layer

if TYPE_CHECKING:
    from tensorfold.adapters.stream_state import StreamSlots


class SlidingRows:
    """One pass's sliding layers. `shared`: the store layers whose rows a later reuse layer reads;
    their new rows [N, kv_heads, head_dim] are held and their rings advance after the last
    reader (`pending`)."""

    def __init__(self, fp: ForwardPass, slots: "StreamSlots", shared: frozenset[int]):
        self.fp = fp
        self.slots = slots
        self.shared = shared
        self.pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last_reader: dict[int, int] | None = None

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
        ring_k, ring_v = (self.slots.get(f"L{src}.{kv}") for kv in ("sk", "sv"))
        if new is None:
            k, v = self.pending[src]
        else:
            k, v = new
        out = ring_attention(q, k, v, ring_k, ring_v, self.fp, scale=scale, window=layer.window)
        if new is not None:
            self._tap(f"L{src}", ring_k, ring_v, k, v, layer.window)
            if src in self.shared:
                self.pending[src] = (k, v)
                return out
        elif layer.index != self._last_readers(layers)[src]:
            return out
        else:
            del self.pending[src]
        advance_rings(ring_k, k, self.fp)
        advance_rings(ring_v, v, self.fp)
        return out

    def _last_readers(self, layers: Sequence[Layer]) -> dict[int, int]:
        if self.last_reader is None:
            self.last_reader = {}
            for other in layers:
                if other.reuses_kv:
                    self.last_reader[other.kv_source] = other.index
        return self.last_reader

    def _tap(self, name: str, ring_k: torch.Tensor, ring_v: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, window: int) -> None:
        """The rings as they stand after row p - 1, at each tap p of the pass's runs (taps occur
        only in eager passes, whose streams are real, so a host loop is fine)."""
        fp = self.fp
        if not any(stream.taps for stream in fp.streams):
            return
        rows = gather_window(ring_k, ring_v, k, v, fp, window)
        for i, stream in enumerate(fp.streams):
            for p in stream.taps:
                for kv, gathered in (("sk", rows.keys[i]), ("sv", rows.values[i])):
                    fp.tap(i, p, f"{name}.{kv}", ring_after(gathered, rows.bases[i], p, window))
