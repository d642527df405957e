"""Gemma 4's sliding layers on per-stream rings instead of pages.

A sliding layer that owns its K/V keeps only the rows its window reads: a ring of a stream's last
W-1 rows, fixed state `L{i}.sk` / `L{i}.sv` [W-1, kv_heads, head_dim] in the model's dtype,
indexed by absolute position mod W-1 (core/ops/window_attention.py). The prompt store snapshots
the rings at marks, tapped inside the pass that computes them, so a kept prompt holds the last
W-1 sliding rows it needs to resume. Reuse layers read their store layer's rows of the pass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorfold.family import StateSpec
from tensorfold.forward_pass import ForwardPass
from tensorfold.ops.window_attention import (
    WindowRows, advance_rings, gather_window, ring_after,
)

from .config import Layer

if TYPE_CHECKING:
    from tensorfold.adapters.stream_state import StreamSlots


def ring_specs(layer: Layer, dtype: str) -> tuple[StateSpec, StateSpec]:
    """The fixed state of a sliding layer that owns its K/V: its K and V rings."""
    assert layer.window is not None and not layer.reuses_kv
    shape = (layer.window - 1, layer.kv_heads, layer.head_dim)
    name = f"L{layer.index}"
    return StateSpec(f"{name}.sk", shape, dtype), StateSpec(f"{name}.sv", shape, dtype)


class SlidingRows:
    """One pass's sliding-layer rows. `shared`: the layers whose rows a later reuse layer reads,
    held until the pass ends."""

    def __init__(self, fp: ForwardPass, slots: "StreamSlots", shared: frozenset[int]):
        self.fp = fp
        self.slots = slots
        self.shared = shared
        self.kept: dict[int, WindowRows] = {}

    def write(self, layer: Layer, k: torch.Tensor, v: torch.Tensor) -> WindowRows:
        """k, v [N, kv_heads, head_dim]: the pass's new rows of a sliding layer that owns them.
        Gathers each stream's window from its ring and the new rows, taps the rings at the runs'
        marks, then moves the rings on past the runs."""
        assert layer.window is not None
        fp, name = self.fp, f"L{layer.index}"
        ring_k, ring_v = self.slots.get(f"{name}.sk"), self.slots.get(f"{name}.sv")
        rows = gather_window(ring_k, ring_v, k, v, fp, layer.window)
        for i, stream in enumerate(fp.streams):
            for p in stream.taps:
                for kv, gathered in (("sk", rows.keys[i]), ("sv", rows.values[i])):
                    fp.tap(i, p, f"{name}.{kv}", ring_after(gathered, rows.bases[i], p,
                                                            layer.window))
        advance_rings(ring_k, k, fp)
        advance_rings(ring_v, v, fp)
        if layer.index in self.shared:
            self.kept[layer.index] = rows
        return rows

    def read(self, layer: Layer) -> WindowRows:
        """The rows of the store layer a reuse layer reads, from earlier in this pass."""
        return self.kept[layer.kv_source]
