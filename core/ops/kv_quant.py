"""fp8 KV rows (TF_KV_DTYPE=fp8, see tensorfold.kv_dtype): quantize on write, dequantize on read.

A row x [..., D] is stored as q = x / s in float8 e4m3 with s = amax(|x|, over D) / 448 (1 for
an all-zero row), s float32 [..., 1] beside it: elementwise work on the row alone, so a row's
bits never depend on the other rows of a pass. Readers fold s in after the products over D
(score · s_k, p · s_v), which keeps the e4m3 values exact in any compute dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value


def quantize_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values [N, ..., D] -> (q [N, ..., D] e4m3, scales [N, ..., 1] float32)."""
    x = values.float()
    amax = x.abs().amax(-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # the clamp only catches a last-bit overshoot of amax / s: e4m3fn has no inf, it would NaN
    q = (x / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored rows back in float32: q.float() * scales, or q.float() for unquantized rows."""
    return q.float() if scales is None else q.float() * scales


def index_copy_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """dst.index_copy_(0, index, src), also for e4m3 tensors (torch has no index_copy_ for
    them: the bytes are copied instead, which is the same)."""
    if dst.dtype == FP8_DTYPE:
        dst, src = dst.view(torch.uint8), src.to(FP8_DTYPE).view(torch.uint8)
    dst.index_copy_(0, index, src)
