"""Per-stream fixed state: one slot a lane, for state that is not paged (conv tails, recurrent
states). Slot tensors are [num_slots, *shape]; a stream that starts at row 0 starts from zeros,
which the family applies itself, so a slot is never read before its stream wrote it."""

from __future__ import annotations

from typing import Sequence

import torch

from tensorfold.adapters.paged_kv import TORCH_DTYPES
from tensorfold.family import StateSpec


class StreamSlots:
    def __init__(self, specs: Sequence[StateSpec], num_slots: int, device: str = "cpu"):
        self.specs = {s.name: s for s in specs}
        self.num_slots = num_slots
        self.buffers: dict[str, torch.Tensor] = {
            s.name: torch.zeros(num_slots, *s.shape, dtype=TORCH_DTYPES[s.dtype], device=device)
            for s in specs
        }

    def get(self, name: str) -> torch.Tensor:
        """[num_slots, *shape]"""
        return self.buffers[name]

    def copy(self, src: int, dst: int) -> None:
        """Slot dst's state becomes slot src's (a forked choice starts from its prompt's)."""
        for buf in self.buffers.values():
            buf[dst].copy_(buf[src])

    def poison(self, slot: int) -> None:
        for buf in self.buffers.values():
            buf[slot] = float("nan")
