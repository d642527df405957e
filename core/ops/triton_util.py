"""Helpers shared by the Triton kernels."""

from __future__ import annotations

import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU tests), where tl.dot mishandles bf16 operands."""
    return bool(triton.knobs.runtime.interpret)


if interpreting():
    from .triton_interpret import install

    install()  # the interpreter's dots summed in a fixed order, so row invariance is testable


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b, fp32 accumulation; fp32 operands in full precision (IEEE), not tf32."""
    if INTERP:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out
