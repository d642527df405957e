"""When the ops take their Triton kernels: tensors on CUDA, Triton importable, and not turned off
(benchmarks turn them off to time the torch references on the same GPU). The CPU path never
imports Triton."""

from __future__ import annotations

import importlib.util

import torch

_enabled = True
_on_cpu = False
_have_triton: bool | None = None


def set_triton(enabled: bool, *, on_cpu: bool = False) -> None:
    """Turn the Triton kernels on or off for CUDA tensors (on by default). on_cpu: use them for
    CPU tensors too, under TRITON_INTERPRET=1 (tests of the GPU path on the CPU)."""
    global _enabled, _on_cpu
    _enabled = enabled
    _on_cpu = on_cpu


def have_triton() -> bool:
    global _have_triton
    if _have_triton is None:
        _have_triton = importlib.util.find_spec("triton") is not None
    return _have_triton


def use_triton(t: torch.Tensor) -> bool:
    return (t.is_cuda or _on_cpu) and _enabled and have_triton()
