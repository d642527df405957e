"""fp8 KV rows (TF_KV_DTYPE=fp8, see tensorfold.kv_dtype): quantize on write, dequantize on read.

A row x [..., D] is stored as q = x / s in float8 e4m3 with s = amax(|x|, over D) / 448 (1 for
an all-zero row), s float32 [..., 1] beside it: elementwise work on the row alone, so a row's
bits never depend on the other rows of a pass. Readers fold s in after the products over D
(score · s_k, p · s_v), which keeps the e4m3 values exact in any compute dtype.

Writers call `write_quantized` (rows into e4m3 buffers at an index) or `quantize` (fresh
rows): on the GPU one Triton launch (triton_kv_quant) does K and V together, quantizing and
scattering, with the bits `quantize_rows` + `index_copy_rows` give on the CPU (the reference, the
CPU path). (torch on CUDA divides by the scalar 448 as a multiply by its reciprocal, so the torch
reference run on a GPU may differ from both in a scale's last bit.)
"""

from __future__ import annotations

from typing import Sequence

import torch

from .gpu import use_triton

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


def copy_rows_many(index: torch.Tensor, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """index_copy_rows(dst, index, src) for each (dst, src) of pairs; on the GPU the pairs not
    stored as e4m3 take one launch for each MAX_PAIRS (triton_scatter.scatter_rows)."""
    plain = [(d, s) for d, s in pairs if d.dtype != FP8_DTYPE]
    if plain and use_triton(index):
        from .triton_scatter import MAX_PAIRS, scatter_rows

        for i in range(0, len(plain), MAX_PAIRS):
            scatter_rows(index, plain[i : i + MAX_PAIRS])
        pairs = [(d, s) for d, s in pairs if d.dtype == FP8_DTYPE]
    for dst, src in pairs:
        index_copy_rows(dst, index, src)


def write_quantized(
    index: torch.Tensor, writes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> None:
    """Each (values [N, *S, D], dst [R, *S, D] e4m3, scales [R, *S, 1] float32) of writes:
    values quantized (quantize_rows) into dst at rows index [N], their scales into scales at the
    same rows. On the GPU one launch for each two writes (K and V together)."""
    if writes and use_triton(writes[0][0]):
        from .triton_kv_quant import quantize_scatter

        for i in range(0, len(writes), 2):
            quantize_scatter(index, writes[i : i + 2])
        return
    for values, dst, scales in writes:
        q, s = quantize_rows(values)
        index_copy_rows(dst, index, q)
        scales.index_copy_(0, index, s)


def quantize(*values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """quantize_rows of each of values ([N, ..., D]; on the GPU one launch for each two)."""
    if values and use_triton(values[0]):
        from .triton_kv_quant import quantize_scatter

        out = [
            (
                torch.empty(v.shape, dtype=FP8_DTYPE, device=v.device),
                torch.empty(*v.shape[:-1], 1, dtype=torch.float32, device=v.device),
            )
            for v in values
        ]
        for i in range(0, len(values), 2):
            quantize_scatter(None, [(v, *o) for v, o in zip(values[i : i + 2], out[i : i + 2])])
        return out
    return [quantize_rows(v) for v in values]
