"""Rows copied into paged buffers in one launch (core/ops/triton_scatter.py) against torch's
index_copy_, bit for bit, on the CPU under TRITON_INTERPRET=1; and that the writers take it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold.adapters.paged_kv import PagedRows  # noqa: E402
from tensorfold.family import RowSpec  # noqa: E402
from tensorfold.ops import gpu, kv_quant, triton_scatter  # noqa: E402
from tensorfold.ops.kv_quant import FP8_DTYPE, copy_rows_many, index_copy_rows  # noqa: E402


def _buffers(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(24, 3, 40, generator=g).to(torch.bfloat16),  # a [heads, D] row
        torch.randn(24, 1100, generator=g),  # wider than a block: two column steps
        torch.randn(24, 7, generator=g).to(torch.float16),
        torch.randn(24, 5, generator=g).to(FP8_DTYPE),  # e4m3: index_copy_rows' byte copy
        torch.randn(24, generator=g),
    ]  # a scalar row


def test_rows_in_one_launch_equal_index_copy_a_buffer_at_a_time(monkeypatch):
    g = torch.Generator().manual_seed(1)
    index = torch.tensor([7, 0, 23, 12, 3])
    wide = torch.randn(5, 1200, generator=g)  # a column slice: strided rows
    src = [
        torch.randn(5, 3, 40, generator=g).to(torch.bfloat16),
        wide[:, 50:1150],
        torch.randn(5, 7, generator=g).to(torch.float16),
        torch.randn(5, 5, generator=g).to(FP8_DTYPE),
        torch.randn(5, generator=g),
    ]
    want = _buffers(2)
    for d, s in zip(want, src):
        index_copy_rows(d, index, s)
    launches = []
    real = triton_scatter.scatter_rows
    monkeypatch.setattr(
        triton_scatter, "scatter_rows", lambda i, p: (launches.append(len(p)), real(i, p))[1]
    )
    monkeypatch.setattr(triton_scatter, "MAX_PAIRS", 3)  # four plain pairs: two launches
    got = _buffers(2)
    gpu.set_triton(True, on_cpu=True)
    try:
        copy_rows_many(index, list(zip(got, src)))
    finally:
        gpu.set_triton(True)
    assert launches == [3, 1]
    for d, w in zip(got, want):
        assert torch.equal(d.view(torch.uint8), w.view(torch.uint8))
    copy_rows_many(index[:0], [(got[0], src[0][:0])])  # no rows: nothing written
    assert torch.equal(got[0], want[0])


def test_paged_rows_write_many_takes_one_launch_for_its_plain_buffers(monkeypatch):
    specs = [
        RowSpec("L0.latent", (40,), "bfloat16"),
        RowSpec("L0.index_k", (16,), "bfloat16"),
        RowSpec("L0.index_gate", (16,), "float32"),
    ]
    index = torch.tensor([5, 2, 9])
    g = torch.Generator().manual_seed(3)
    values = [
        torch.randn(3, 40, generator=g).to(torch.bfloat16),
        torch.randn(3, 16, generator=g).to(torch.bfloat16),
        torch.randn(3, 16, generator=g),
    ]
    items = [(s.name, v) for s, v in zip(specs, values)]
    calls = []
    real = kv_quant.index_copy_rows
    monkeypatch.setattr(
        kv_quant, "index_copy_rows", lambda d, i, s: (calls.append(1), real(d, i, s))[1]
    )
    out = []
    for on in (False, True):
        paged = PagedRows(specs, num_pages=3, page_rows=4)
        for buf in paged.buffers.values():
            buf.fill_(7.0)
        calls.clear()
        gpu.set_triton(on, on_cpu=on)
        try:
            paged.write_many(index, items)
        finally:
            gpu.set_triton(True)
        assert len(calls) == (0 if on else 3)
        out.append(paged.buffers)
    for name in out[0]:
        assert torch.equal(out[1][name], out[0][name]), name
    assert torch.equal(out[1]["L0.latent"][index], values[0])
