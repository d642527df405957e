"""When the ops take their Triton kernels: tensors on CUDA, Triton importable, and not turned off
(benchmarks turn them off to time the torch references on the same GPU). The CPU path never
imports Triton."""

from __future__ import annotations

import importlib.util

import torch

_enabled = True
_on_cpu = False
_have_triton: bool | None = None
_dependent_launch = True
_prefetch_weights = False
_pdl_devices: dict[int, bool] = {}


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


def set_dependent_launch(enabled: bool) -> None:
    """Launch the kernels that wait for their predecessor (triton_util.after_prior) with
    programmatic dependent launch on GPUs that have it (on by default; TF_DEPENDENT_LAUNCH)."""
    global _dependent_launch
    _dependent_launch = enabled


def set_prefetch_weights(enabled: bool) -> None:
    """Let kernels launched with PDL prefetch part of their weights into L2 before they wait for
    their predecessor (off by default; TF_PREFETCH_WEIGHTS). A hint: results are the same."""
    global _prefetch_weights
    _prefetch_weights = enabled


PREFETCH_BYTES = 8 << 20  # prefetched by one launch at most (an H200's L2 is 50 MB)


def prefetch_k(w: torch.Tensor, rows: int) -> int:
    """How many elements of each weight row range a kernel prefetches before its wait
    (triton_util.prefetch_l2), for a launch that reads `rows` row ranges of w (rows of distinct
    matrices, or the chunks of split rows): a power of two, so that the launch prefetches
    PREFETCH_BYTES at most; 0 (off) without PDL (fp8 weights' products have none), below 64
    elements, or when w's rows do not start 16-byte aligned."""
    fp8 = w.dtype == torch.float8_e4m3fn
    if not (_prefetch_weights and launch_options(w, dependent=not fp8)["PDL"]):
        return 0
    size = w.element_size()
    if w.data_ptr() % 16 or any(s * size % 16 for s in w.stride()[:-1]):
        return 0
    per_row = PREFETCH_BYTES // (max(rows, 1) * size)
    return 1 << (per_row.bit_length() - 1) if per_row >= 64 else 0


def launch_options(t: torch.Tensor, dependent: bool = True) -> dict[str, bool]:
    """The PDL keywords for a kernel launch on t's device: each kernel then starts while the one
    before it finishes (the launch gap between small decode kernels hides), and waits for it in
    after_prior. Hopper (sm_90) and newer, not under the interpreter. dependent=False: launched
    in stream order (the products over fp8 weights, which run slower placed early:
    docs/performance.md, "FP8_DEPENDENT_LAUNCH")."""
    if not (dependent and t.is_cuda and _dependent_launch):
        return {"PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    ok = _pdl_devices.get(index)
    if ok is None:
        ok = _pdl_devices[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if ok else {"PDL": False}
