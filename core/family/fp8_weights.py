"""fp8 weights: a linear's (or a stack of experts') float8 e4m3 values with float32 block scales.

`Fp8Weight` is the record the checkpoint hands a family for a quantized linear, whatever the
format on disk (block-scaled `weight_scale_inv`, compressed-tensors' per-channel or per-tensor
`weight_scale`, or a model-dtype weight quantized at load): element (n, k) of the weight is
`q[n, k] · scale[(n + row0) // bn, k // bk]` in fp32, row0 the rows its first row block starts
before q's row 0 (0 but for a cut of rows off the block edges). It lives in the family room
because the checkpoint builds it; ops dispatch on it (`tensorfold.ops.fp8`, which re-exports
these names).

Every reshaping here is exact. A range of rows is a view of the codes and of the scales of the
row blocks it touches, with row0 where it starts inside one (a fused gate/up's up half at row
I, I no multiple of 128). A column range off the block edges, and a concatenation whose parts
do not end and start on block edges, refine the scales to one column (or one row) per scale,
repeating each block's scale; so the values (and so every product) are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
RELEASE_BLOCK = (128, 128)  # the block of the FP8 releases (DeepSeek, Qwen, GLM)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


@dataclass(frozen=True, eq=False)
class Fp8Weight:
    """q [N, K] (a linear) or [E, N, K] (stacked experts) in float8 e4m3; scale [...,
    ceil((row0 + N) / bn), ceil(K / bk)] in float32; block (bn, bk): (128, 128) block-scaled,
    (1, K) per channel, (N, K) per tensor; row0 (0 <= row0 < bn): q's row 0 is row row0 of its
    first row block (a row cut inside a block), so row n takes scale row (n + row0) // bn.
    Compared and hashed by identity, as tensors are."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    row0: int = 0

    def __post_init__(self) -> None:
        if self.q.dtype != FP8_DTYPE or self.scale.dtype != torch.float32:
            raise ValueError(
                f"Fp8Weight: q must be {FP8_DTYPE} and scale float32, "
                f"got {self.q.dtype} and {self.scale.dtype}"
            )
        bn, bk = self.block
        if not 0 <= self.row0 < bn:
            raise ValueError(f"Fp8Weight: row0 {self.row0} is outside a row block of {bn}")
        n, k = self.q.shape[-2:]
        want = (*self.q.shape[:-2], _blocks(self.row0 + n, bn), _blocks(k, bk))
        if self.q.dim() not in (2, 3) or tuple(self.scale.shape) != want:
            raise ValueError(
                f"Fp8Weight: q {list(self.q.shape)} with block {self.block} and row0 "
                f"{self.row0} needs scale {list(want)}, got {list(self.scale.shape)}"
            )

    # --- what a weight tensor answers ---

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def dtype(self) -> torch.dtype:
        """The stored values' dtype (float8 e4m3); a product comes out in its input's dtype."""
        return self.q.dtype

    def dim(self) -> int:
        return self.q.dim()

    def numel(self) -> int:
        """The weight's elements (its values, not its scales)."""
        return self.q.numel()

    @property
    def nbytes(self) -> int:
        """Bytes held: the fp8 values and their scales."""
        return self.q.nbytes + self.scale.nbytes

    def __len__(self) -> int:
        return len(self.q)

    def __getitem__(self, index: int | slice | tuple[slice, slice]) -> "Fp8Weight":
        """An expert of a stack (an int on [E, N, K]), a range of rows (a slice, step 1), or
        every expert's range of rows (`[:, a:b]` on a stack)."""
        if isinstance(index, tuple):
            every, rows = index
            if self.q.dim() != 3 or every != slice(None) or rows.step not in (None, 1):
                raise ValueError("Fp8Weight: a pair index is [:, a:b] on a [E, N, K] stack")
            start, stop, _ = rows.indices(self.q.shape[1])
            return self.narrow(0, start, stop - start)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("Fp8Weight: only unit-step slices")
            if self.q.dim() == 3:
                return replace(self, q=self.q[start:stop], scale=self.scale[start:stop])
            return self.narrow(0, start, stop - start)
        if self.q.dim() != 3:
            raise TypeError("Fp8Weight: an int index takes an expert of a [E, N, K] stack")
        return replace(self, q=self.q[index], scale=self.scale[index])

    def split(self, sizes: Sequence[int]) -> list["Fp8Weight"]:
        """Consecutive row ranges of these sizes (as Tensor.split on dim 0 of a [N, K] weight)."""
        out, row = [], 0
        for size in sizes:
            out.append(self.narrow(0, row, size))
            row += size
        return out

    def to(self, device: torch.device | str) -> "Fp8Weight":
        return replace(self, q=self.q.to(device), scale=self.scale.to(device))

    # --- values ---

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight q · scale, each element one fp32 product rounded once to `dtype`: the
        values the GPU's fp8 kernels turn the codes into in registers (ops.triton_fp8). Each
        block's scale broadcast over its (padded) rows and columns: no [N, K] copy of them; the
        rows padded above by row0, so q's rows sit in their blocks."""
        bn, bk = self.block
        n, k = self.q.shape[-2:]
        r0 = self.row0
        nb, kb = _blocks(r0 + n, bn), _blocks(k, bk)
        lead = self.q.shape[:-2]
        w = self.q.float()
        if nb * bn != n or kb * bk != k:
            w = torch.nn.functional.pad(w, (0, kb * bk - k, r0, nb * bn - n - r0))
        w = w.reshape(*lead, nb, bn, kb, bk) * self.scale.reshape(*lead, nb, 1, kb, 1)
        return w.reshape(*lead, nb * bn, kb * bk)[..., r0 : r0 + n, :k].to(dtype).contiguous()

    # --- exact reshaping ---

    def refine(self, dim: int) -> "Fp8Weight":
        """The same values with one scale per row (dim 0) or column (dim 1) of each block:
        the block's size along `dim` becomes 1 (row0 0). dim counts from the matrix: 0 is N, 1
        is K."""
        bn, bk = self.block
        size = self.q.shape[-2 + dim]
        b = (bn, bk)[dim]
        if b == 1:
            return self
        axis = self.scale.dim() - 2 + dim
        skip = self.row0 if dim == 0 else 0
        scale = self.scale.repeat_interleave(b, dim=axis).narrow(axis, skip, size).contiguous()
        if dim == 0:
            return Fp8Weight(self.q, scale, (1, bk))
        return Fp8Weight(self.q, scale, (bn, 1), self.row0)

    def narrow(self, dim: int, start: int, length: int) -> "Fp8Weight":
        """Rows (dim 0) or columns (dim 1) start..start+length of the matrix (of each expert):
        rows as views of the codes and of their blocks' scales (row0 where the cut starts
        inside a block), columns off the block edges with their scales refined."""
        axis = self.q.dim() - 2 + dim
        scale, block, row0 = narrow_scale(
            self.scale, self.block, self.q.shape, dim, start, length, self.row0
        )
        return Fp8Weight(self.q.narrow(axis, start, length), scale, block, row0)


def narrow_scale(
    scale: torch.Tensor,
    block: tuple[int, int],
    shape: Sequence[int],
    dim: int,
    start: int,
    length: int,
    row0: int = 0,
) -> tuple[torch.Tensor, tuple[int, int], int]:
    """The scales, block and row0 of rows (dim 0) or columns (dim 1) start..start+length of a
    weight of `shape` [..., N, K] whose row 0 is row `row0` of its first row block. Rows: a
    view of the row blocks the range touches, row0 where it starts inside one. Columns: one
    block across all of K (per tensor, per channel) stays one; a cut off the block edges
    refines the scales first (one a column)."""
    axis = scale.dim() - 2 + dim
    if dim == 0:
        first, at = divmod(row0 + start, block[0])
        last = _blocks(row0 + start + length, block[0])
        return scale.narrow(axis, first, last - first), block, at
    size, b = shape[-1], block[1]
    end = start + length
    if b >= size:  # one block along K: every cut keeps it
        return scale, block, row0
    if start % b or (end % b and end != size):
        scale = scale.repeat_interleave(b, dim=axis).narrow(axis, 0, size)
        block, b = (block[0], 1), 1
    first, last = start // b, _blocks(end, b)
    return scale.narrow(axis, first, last - first).contiguous(), block, row0


def _ends_on_edge(w: Fp8Weight) -> bool:
    """Whether the weight's last row ends a row block (a concatenation may follow it as is)."""
    return (w.row0 + w.shape[-2]) % w.block[0] == 0


def cat_rows(parts: Sequence[torch.Tensor | Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """The parts' rows in order as one weight [ΣN, K]: an Fp8Weight when every part is one (its
    blocks kept, and the first's row0, where each part but the last ends a row block and each
    but the first starts one; else refined to one scale a row), a tensor when none is; a mix is
    dequantized to the plain parts' dtype."""
    fp8 = [p for p in parts if isinstance(p, Fp8Weight)]
    plain = [p for p in parts if not isinstance(p, Fp8Weight)]
    if not fp8:
        return torch.cat(plain)  # type: ignore[arg-type]
    if plain:
        dtype = plain[0].dtype
        return torch.cat([p.dequantize(dtype) if isinstance(p, Fp8Weight) else p for p in parts])
    if len({w.block[1] for w in fp8}) != 1 or len({w.shape[-1] for w in fp8}) != 1:
        raise ValueError("cat_rows: the parts' columns or column blocks differ")
    aligned = (
        len({w.block[0] for w in fp8}) == 1
        and all(_ends_on_edge(w) for w in fp8[:-1])
        and not any(w.row0 for w in fp8[1:])
    )
    if not aligned:
        fp8 = [w.refine(0) for w in fp8]
    q, scale = torch.cat([w.q for w in fp8]), torch.cat([w.scale for w in fp8])
    return Fp8Weight(q, scale, fp8[0].block, fp8[0].row0)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int] = RELEASE_BLOCK) -> Fp8Weight:
    """w [N, K] or [E, N, K] in e4m3 with one fp32 scale a (bn, bk) block, as the FP8 releases
    quantize: scale = amax(|block|) / 448 (1 for an all-zero block), q = w / scale rounded to
    e4m3. Correctly rounded operations only, so the CPU and the GPU give the same bits. A stack
    is quantized a matrix at a time, and a matrix in one fp32 copy: the transient memory is one
    matrix's fp32 bytes."""
    if w.dim() == 3:
        first = quantize_blocks(w[0], block)
        q = first.q.new_empty(w.shape)
        scale = first.scale.new_empty(len(w), *first.scale.shape)
        q[0], scale[0] = first.q, first.scale
        for e in range(1, len(w)):
            one = quantize_blocks(w[e], block)
            q[e], scale[e] = one.q, one.scale
        return Fp8Weight(q, scale, block)
    bn, bk = block
    n, k = w.shape
    pad_n, pad_k = (-n) % bn, (-k) % bk
    padded = torch.nn.functional.pad(w.float(), (0, pad_k, 0, pad_n))
    if padded.data_ptr() == w.data_ptr():  # divided in place below: never the caller's tensor
        padded = padded.clone()
    tiles = padded.view((n + pad_n) // bn, bn, (k + pad_k) // bk, bk)
    amax = tiles.abs().amax(dim=(1, 3))  # [N/bn, K/bk]
    # a tensor divisor: CUDA divides by a Python number as a multiply by its reciprocal, which
    # is not correctly rounded (the GPU's scales then differ from the CPU's)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    tiles.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return Fp8Weight(padded[:n, :k].to(FP8_DTYPE), scale, block)


def fp8_bytes(shape: Sequence[int], block: tuple[int, int] = RELEASE_BLOCK) -> int:
    """Bytes of a weight of `shape` quantized to `block`: one a value, four a scale."""
    *lead, n, k = shape
    count = 1
    for d in lead:
        count *= d
    return count * (n * k + 4 * _blocks(n, block[0]) * _blocks(k, block[1]))


def empty_stack(like: torch.Tensor | Fp8Weight, count: int) -> torch.Tensor | Fp8Weight:
    """Room for `count` weights shaped and stored as `like` [N, K], stacked [count, N, K]: a
    family fills it one expert at a time (`put`), so a layer's experts are never held twice."""
    if isinstance(like, Fp8Weight):
        q = like.q.new_empty(count, *like.q.shape)
        return replace(like, q=q, scale=like.scale.new_empty(count, *like.scale.shape))
    return like.new_empty(count, *like.shape)


def put(stack: torch.Tensor | Fp8Weight, index: int, one: torch.Tensor | Fp8Weight) -> None:
    """stack[index] = one: both fp8 with the same block, or both tensors."""
    if isinstance(stack, Fp8Weight) != isinstance(one, Fp8Weight):
        raise ValueError("put: an expert is not stored as the layer's others (fp8 or not)")
    if isinstance(stack, Fp8Weight) and isinstance(one, Fp8Weight):
        if (one.block, one.row0) != (stack.block, stack.row0) or (
            one.scale.shape != stack.scale.shape[1:]
        ):
            raise ValueError(f"put: an expert's scales {one.block} differ from its layer's")
        stack.q[index].copy_(one.q)
        stack.scale[index].copy_(one.scale)
    elif isinstance(stack, torch.Tensor) and isinstance(one, torch.Tensor):
        stack[index].copy_(one)
