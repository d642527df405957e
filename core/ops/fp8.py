"""fp8 weights (issue 58): the record and its arithmetic, as ops and families use them.

A quantized linear is an `Fp8Weight` (q in float8 e4m3 with float32 block scales; defined in
`tensorfold.family.fp8_weights`, where the checkpoint builds it, and re-exported here).
`ops.linear.linear` takes one in place of a weight tensor (`linear_fp8`: by definition the
product with the weight dequantized to the input's dtype), and `ops.moe` takes fp8 expert stacks.

On the GPU the products run in the fp8 kernels of `triton_fp8` (the e4m3 codes read as stored,
with the bits of the bf16 kernels over the dequantized weight) wherever `kernels_take` the
weights (`fp8_dispatch`); a weight whose column blocks the kernels cannot read is dequantized
instead. The kernels' torch references are here: the ops over the dequantized weights.
"""

from __future__ import annotations

import torch

from ..family.fp8_weights import (
    FP8_DTYPE,
    FP8_MAX,
    RELEASE_BLOCK,
    Fp8Weight,
    cat_rows,
    empty_stack,
    fp8_bytes,
    put,
    quantize_blocks,
)
from .fp8_dispatch import KERNEL_BK, kernel_reads, kernels_take, kernels_take_ffn
from .linear import linear, linear_fp8
from .moe import gated_ffn, moe

# (q, scale, block, row0): an fp8 weight as triton_fp8's kernels take it
Fp8Parts = tuple[torch.Tensor, torch.Tensor, tuple[int, int], int]

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "RELEASE_BLOCK",
    "Fp8Weight",
    "cat_rows",
    "empty_stack",
    "KERNEL_BK",
    "fp8_bytes",
    "kernel_reads",
    "kernels_take",
    "kernels_take_ffn",
    "Fp8Parts",
    "dequantized",
    "gated_ffn_fp8_reference",
    "linear_fp8",
    "linear_fp8_reference",
    "moe_fp8_reference",
    "put",
    "quantize_blocks",
]


# --- the torch references of triton_fp8's kernels: the ops over the dequantized weights ---


def dequantized(w: Fp8Parts, dtype: torch.dtype) -> torch.Tensor:
    """The weight the kernels multiply by: Fp8Weight.dequantize of (q, scale, block, row0)."""
    return Fp8Weight(*w).dequantize(dtype)


def linear_fp8_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    row0: int = 0,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """linear_fp8's arithmetic in torch: ops.linear.linear over the weight dequantized to x's
    dtype."""
    return linear(x, dequantized((q, scale, block, row0), x.dtype), bias, out_dtype)


def moe_fp8_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w1: Fp8Parts,
    w3: Fp8Parts,
    w2: Fp8Parts,
    **kw,
) -> torch.Tensor:
    """moe_fp8's arithmetic in torch: ops.moe.moe (its keywords: act, limit, fp32_slots) over
    the experts dequantized to x's dtype."""
    w = [dequantized(p, x.dtype).unbind(0) for p in (w1, w3, w2)]
    out = moe(x, weights, experts, *w, **kw)
    assert isinstance(out, torch.Tensor)
    return out


def gated_ffn_fp8_reference(
    x: torch.Tensor, w1: Fp8Parts, w3: Fp8Parts, w2: Fp8Parts, **kw
) -> torch.Tensor:
    """gated_ffn_fp8's arithmetic in torch: ops.moe.gated_ffn over the weights dequantized."""
    return gated_ffn(x, *(dequantized(p, x.dtype) for p in (w1, w3, w2)), **kw)
