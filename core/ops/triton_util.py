"""Helpers shared by the Triton kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (the CPU tests), where tl.dot mishandles bf16 operands."""
    return bool(triton.knobs.runtime.interpret)


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host. triton.cdiv and triton.next_power_of_2 are constexpr functions whose
    wrapper costs about 1-2 µs a host call, and a 2048-row prompt pass makes about 800 of them."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (0 for 0), as triton.next_power_of_2, on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@dataclass(frozen=True)
class Fp8Scales:
    """An fp8 weight's scales as the kernels read them (triton_fp8 makes them): scale
    [E, row blocks, k blocks] float32 (unit stride along k; E 1 for a lone matrix), row r of
    expert e in k block j scaled by scale[e, (r + row0) // block_n, j] (row0: the weight's
    row 0 lies that far into its first row block, a row cut inside one); block_k a multiple of
    128 (a kernel's BK steps then each lie in one k block) or the whole K."""

    scale: torch.Tensor
    block_n: int
    block_k: int
    row0: int = 0

    def kernel_block_k(self, k: int, step: int) -> int:
        """A kernel's SBK for a product over k in `step`-long steps: block_k, or 0 for one block
        over all of k."""
        if self.block_k >= k:
            return 0
        assert self.block_k % step == 0, (self.block_k, step)
        return self.block_k


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


@triton.jit
def after_prior(PDL: tl.constexpr):
    """Under programmatic dependent launch (PDL, Hopper on): wait until the kernel before this one
    has finished and its writes are visible, then let the next kernel's programs be placed. A
    kernel launched with PDL may start while its predecessor runs, so this comes before the
    kernel's first load or store."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, nbytes, ON: tl.constexpr):
    """A hint: bring nbytes (a multiple of 16; 0 skips) at each of ptrs (16-byte aligned) into
    L2, one bulk prefetch each (sm_90 and newer). For what a kernel reads before after_prior
    (weights): DRAM then stays busy while the kernel before this one finishes. Not ON: nothing
    (the interpreter runs no inline asm)."""
    if ON:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; }"
            " // $0",
            "=r,l,r",
            [ptrs, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def prefetch_rows(w_ptr, rn, stride_n, N, k_lo, k_hi, INTERP: tl.constexpr):
    """prefetch_l2 of w[rn, k_lo:k_hi] (the rows rn < N of a matrix whose rows and k_lo start
    16-byte aligned)."""
    nbytes = tl.maximum(k_hi - k_lo, 0) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
    prefetch_l2(
        w_ptr + rn.to(tl.int64) * stride_n + k_lo,
        tl.where(rn < N, nbytes // 16 * 16, 0),
        not INTERP,
    )


@triton.jit
def publish_writes(INTERP: tl.constexpr):
    """Every thread's earlier global writes made visible GPU-wide, then a barrier: what a program
    writes before it announces itself (an arrival counter) is then there for whoever reads it."""
    if not INTERP:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.debug_barrier()


@triton.jit
def scale_rows(s_ptr, e64, rn, N, stride_se, stride_sn, SBN, ROW0):
    """An fp8 weight's [1, BN] pointers to the scales of its columns rn (rows of the weight, of
    expert e64 in a stack) at k block 0: the scale of row r sits at row block (r + ROW0) // SBN,
    ROW0 the rows its first block starts before row 0 (rows past N read the last row's, never
    stored)."""
    blocks = (tl.minimum(rn, N - 1) + ROW0) // SBN
    return s_ptr + e64 * stride_se + blocks[None, :].to(tl.int64) * stride_sn


@triton.jit
def dot_operand_barrier(x, INTERP: tl.constexpr):
    """x as it is, through an opaque move the compiler neither looks through nor removes. Before
    an MMA, it hides where a 16-bit operand came from: Triton gives an operand it traces back to
    an 8-bit load a 16-row MMA layout of 4 k values a thread (kWidth 4, not 2), which feeds each
    16-long k step's products to the tensor core in another order, and the sums round otherwise
    (1 ulp in a few elements): fp8 weights on 16-row tiles would then differ from the 64- and
    128-row tiles and from the bf16 kernel. 16-bit x only; the interpreter runs no asm."""
    if INTERP:
        out = x
    else:
        out = tl.inline_asm_elementwise(
            "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2
        )
    return out


@triton.jit
def weight_tile(
    w_ptrs,
    mask,
    s_rows,
    k0,
    dt: tl.constexpr,
    FP8: tl.constexpr,
    SBK: tl.constexpr,
    INTERP: tl.constexpr,
):
    """A weight's [BK, BN] tile at w_ptrs (0 where masked out), the BK step at k0, for an MMA in
    dt. FP8: e4m3 codes dequantized in registers, each times its block's scale in fp32, rounded
    to dt: the torch reference's `(q.float() * scale).to(dt)`, then through
    dot_operand_barrier, so the product's bits are those of the same kernel over the
    dequantized weight. s_rows: scale_rows' pointers; the step lies in one k block of SBK (a
    multiple of BK), or SBK is 0 (one block over all of K)."""
    w = tl.load(w_ptrs, mask=mask, other=0.0)
    if FP8:
        if SBK > 0:
            s = tl.load(s_rows + k0 // SBK)
        else:
            s = tl.load(s_rows)
        w = dot_operand_barrier((w.to(tl.float32) * s).to(dt), INTERP)
    return w
