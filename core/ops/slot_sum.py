"""A MoE's output before its slot sum (`SlotSum`), apart from ops/moe.py so that ops/norms.py
can take one without importing the MoE (moe.py re-exports both names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .gpu import use_triton


@dataclass(frozen=True)
class SlotSum:
    """A MoE's output with its slots not yet summed: slots [N, k, H], each row's weighted expert
    outputs in slot order, in the model's dtype. `norms.add_rms_norm` takes it as its x and sums
    the slots on the GPU in its own launch (a launch fewer a MoE layer); total() sums them here.
    Either way: in slot order, in fp32, rounded to the slots' dtype once."""

    slots: torch.Tensor

    def total(self) -> torch.Tensor:
        if use_triton(self.slots):
            from . import triton_moe

            return triton_moe.slot_sum(self.slots)
        return fp32_sum(self.slots).to(self.slots.dtype)


def fp32_sum(slots: torch.Tensor) -> torch.Tensor:
    """slots [N, k, H] summed over k in slot order, in fp32 -> [N, H] fp32."""
    acc = slots[:, 0].float()
    for j in range(1, slots.shape[1]):
        acc = acc + slots[:, j].float()
    return acc


def summed(f: "torch.Tensor | SlotSum") -> torch.Tensor:
    """f as an [N, H] tensor (a SlotSum's total)."""
    return f.total() if isinstance(f, SlotSum) else f
