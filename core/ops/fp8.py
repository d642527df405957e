"""fp8 weights (issue 58): the record and its arithmetic, as ops and families use them.

A quantized linear is an `Fp8Weight` (q in float8 e4m3 with float32 block scales; defined in
`tensorfold.family.fp8_weights`, where the checkpoint builds it, and re-exported here).
`ops.linear.linear` takes one in place of a weight tensor (`linear_fp8`: the product with the
weight dequantized to the input's dtype), and `ops.moe` takes fp8 expert stacks.
"""

from __future__ import annotations

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
from .linear import linear_fp8

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "RELEASE_BLOCK",
    "Fp8Weight",
    "cat_rows",
    "empty_stack",
    "fp8_bytes",
    "linear_fp8",
    "put",
    "quantize_blocks",
]
