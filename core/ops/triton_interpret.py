"""Triton's CPU interpreter, made row invariant as the GPU is.

The interpreter computes `tl.dot` with numpy's matmul, that is with the machine's BLAS, whose
summation order for an output element can depend on where its row sits in the block and on the
kernel the CPU picks (OPENBLAS_CORETYPE shows it: a row alone and the same row in a batch differ
on one machine and agree on another). On the GPU an MMA sums every row of a tile in the same
order, and the kernels' batch-invariance tests check exactly that. So under the interpreter the
dot sums its K products one by one, in order, for every output element: a row's bits then depend
only on the row and the other operand, on any CPU.
"""

from __future__ import annotations

import numpy as np

_installed = False


def fixed_order_matmul(a: np.ndarray, b: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a [..., M, K] @ b [..., K, N] in dtype: each product rounded to dtype, then summed over K
    from k = 0 upward (np.add.accumulate is sequential by definition, unlike a BLAS or np.sum)."""
    products = (
        a.astype(dtype, copy=False)[..., :, :, None] * b.astype(dtype, copy=False)[..., None, :, :]
    )
    if products.shape[-2] == 0:
        return np.zeros(products.shape[:-2] + products.shape[-1:], dtype=dtype)
    return np.add.accumulate(products, axis=-2, dtype=dtype)[..., -1, :]


def install() -> None:
    """Route the interpreter's dot through fixed_order_matmul (once per process; every process that
    imports a Triton kernel of ours under TRITON_INTERPRET=1, TP followers included)."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
            # as the interpreter does: fp8 operands widened to fp16 first
            half = interpreter.tl.float16
            a_data = interpreter._convert_float(a_data, a.dtype, half, None).view(np.float16)
            b_data = interpreter._convert_float(b_data, b.dtype, half, None).view(np.float16)
        out = fixed_order_matmul(a_data, b_data, d.data.dtype) + d.data
        return interpreter.TensorHandle(out, d.dtype.scalar)

    builder.create_dot = create_dot
    _installed = True
