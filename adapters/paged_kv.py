"""The page adapter for per-token rows (K/V, MLA latent, indexer keys).

Each paged buffer is one tensor viewed flat as [num_pages * page_rows, *row_shape]: row `pos` of a
stream lives at flat row `pages[pos // page_rows] * page_rows + pos % page_rows`.

Under TF_KV_DTYPE=fp8 a quantized row's buffer is float8 e4m3 and its scales are the buffer
`NAME.scale` at the same flat rows (tensorfold.memory.kv_dtype): `write` fills both, readers take
`flat(name)` with `scales(name)`. `write_many` writes a layer's K and V together: on the GPU
their fp8 rows take one launch (tensorfold.ops.kv_quant.write_quantized), and the rows of
buffers kept in their own dtype another (kv_quant.copy_rows_many).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tensorfold.family import RowSpec, StateLayout
from tensorfold.family.hookspecs import hookimpl
from tensorfold.memory.kv_dtype import SCALE
from tensorfold.memory.kv_pool import Lease
from tensorfold.ops.kv_quant import FP8_DTYPE, copy_rows_many, write_quantized

TORCH_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
}


class PagedRows:
    """The storage behind the pool's pages for one family: one flat tensor per RowSpec."""

    def __init__(
        self, specs: Sequence[RowSpec], num_pages: int, page_rows: int, device: str = "cpu"
    ):
        self.specs = {s.name: s for s in specs}
        self.num_pages = num_pages
        self.page_rows = page_rows
        self.buffers: dict[str, torch.Tensor] = {
            # empty, not zeros: a row is read only after its stream wrote it, and untouched
            # memory is not committed, so an unused prompt cache costs nothing on the CPU
            s.name: torch.empty(
                num_pages * page_rows, *s.shape, dtype=TORCH_DTYPES[s.dtype], device=device
            )
            for s in specs
        }

    def flat(self, name: str) -> torch.Tensor:
        """[num_pages * page_rows, *row_shape]"""
        return self.buffers[name]

    def scales(self, name: str) -> torch.Tensor | None:
        """[num_pages * page_rows, *row_shape[:-1], 1] float32: the scales of an fp8 buffer's
        rows (stored = value / scale); None for a buffer kept in its own dtype."""
        return self.buffers.get(name + SCALE)

    def write(self, name: str, index: torch.Tensor, values: torch.Tensor) -> None:
        """Store values [N, *row_shape] at flat rows index [N] (quantized, with their scales,
        into an fp8 buffer)."""
        self.write_many(index, [(name, values)])

    def write_many(self, index: torch.Tensor, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """write(name, index, values) for each (name, values) of items; the fp8 ones quantized
        together (one launch for K and V on the GPU)."""
        quantized, copied = [], []
        for name, values in items:
            buf, scales = self.buffers[name], self.scales(name)
            if buf.dtype == FP8_DTYPE and scales is not None:
                quantized.append((values, buf, scales))
            else:
                copied.append((buf, values.to(buf.dtype)))
        if copied:
            copy_rows_many(index, copied)
        if quantized:
            write_quantized(index, quantized)

    def _page_view(self, name: str) -> torch.Tensor:
        buf = self.buffers[name]
        return buf.view(self.num_pages, self.page_rows, *buf.shape[1:])

    def poison(self, pages: Sequence[int]) -> None:
        """Fill pages with NaN, so a read of a freed or detached row changes tokens."""
        if not pages:
            return
        idx = torch.tensor(list(pages), dtype=torch.long)
        for name in self.buffers:
            self._page_view(name)[idx] = float("nan")

    def copy_rows(self, src_page: int, dst_page: int, rows: int) -> None:
        """Copy the first `rows` rows of src_page into dst_page, in every buffer."""
        for name in self.buffers:
            view = self._page_view(name)
            view[dst_page, :rows] = view[src_page, :rows]


@hookimpl
def share_attach(lease: Lease, rows: PagedRows, kept_pages: list[int], kept_rows: int) -> list[int]:
    """Full kept pages are shared by reference (rows below kept_rows are never written again);
    a partial last page is copied into a page of the stream's own, which it writes on from."""
    full = kept_rows // rows.page_rows
    lease.attach(kept_pages[:full])
    partial = kept_rows % rows.page_rows
    if partial:
        table = lease.cover(kept_rows)
        rows.copy_rows(kept_pages[full], table[full], partial)
    return lease.pages


@hookimpl
def share_pool(layout: StateLayout, num_pages: int, page_rows: int, device: str) -> PagedRows:
    return PagedRows(layout.paged, num_pages, page_rows, device)
