"""Snapshot pages for per-stream state that is not paged (conv tails, recurrent states, the
sliding rows a kept prompt needs).

One arena is allocated at start inside the prompt-cache budget: each of its `capacity` snapshot
pages holds one stream's whole fixed state. A keep leases a page and copies into it, a restore
copies back, a drop returns the lease: nothing is allocated per keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from tensorfold.adapters.paged_kv import TORCH_DTYPES
from tensorfold.adapters.stream_state import StreamSlots
from tensorfold.family import StateSpec
from tensorfold.family.hookspecs import hookimpl


@dataclass(eq=False)
class Snapshot:
    page: int  # the arena page it leases


class SnapshotArena:
    def __init__(self, specs: Sequence[StateSpec], capacity: int, device: str = "cpu"):
        self.capacity = capacity
        self.buffers: dict[str, torch.Tensor] = {
            s.name: torch.empty(capacity, *s.shape, dtype=TORCH_DTYPES[s.dtype], device=device)
            for s in specs
        }
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def lease(self) -> Snapshot | None:
        return Snapshot(self._free.pop()) if self._free else None

    def release(self, snapshot: Snapshot) -> None:
        self._free.append(snapshot.page)


@hookimpl
def snap_keep(
    slots: StreamSlots, slot: int, arena: SnapshotArena, taps: Mapping[str, Any] | None
) -> Snapshot | None:
    """Copy the slot's state (or the state tapped mid-pass) into a leased snapshot page."""
    snapshot = arena.lease()
    if snapshot is None:
        return None
    for name, buf in arena.buffers.items():
        source = taps[name] if taps is not None else slots.get(name)[slot]
        buf[snapshot.page].copy_(source)
    return snapshot


@hookimpl
def snap_restore(snapshot: Snapshot, arena: SnapshotArena, slots: StreamSlots, slot: int) -> bool:
    for name, buf in arena.buffers.items():
        slots.get(name)[slot].copy_(buf[snapshot.page])
    return True
