"""The fp8 row writer (core/ops/triton_kv_quant.py) against its torch reference, quantize_rows +
index_copy_rows, bit for bit, on the CPU under TRITON_INTERPRET=1; and that the writers take it
(K and V in one launch)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.adapters.paged_kv import PagedRows  # noqa: E402
from tensorfold.family import RowSpec  # noqa: E402
from tensorfold.memory.kv_dtype import FP8, scale_spec  # noqa: E402
from tensorfold.ops import gpu, kv_quant, triton_kv_quant  # noqa: E402
from tensorfold.ops.kv_quant import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    index_copy_rows,
    quantize,
    quantize_rows,
    write_quantized,
)


@pytest.fixture(autouse=True)
def _kernels_on_the_cpu():
    with testing.interpreter_rounds_like_the_gpu():
        yield
    gpu.set_triton(True)


def reference(index, writes):
    """What write_quantized must store, by the torch reference."""
    for values, dst, scales in writes:
        q, s = quantize_rows(values)
        index_copy_rows(dst, index, q)
        scales.index_copy_(0, index, s)


def kernel(index, writes):
    gpu.set_triton(True, on_cpu=True)
    try:
        write_quantized(index, writes)
    finally:
        gpu.set_triton(True)


def rows(n: int, heads: int, d: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of magnitudes from 1e-12 to 1e6 (e4m3 subnormals included), a zero row, a head with
    a single nonzero value, a row whose largest value sits on a rounding tie, a NaN."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, d, generator=g) * torch.logspace(-12, 6, n)[:, None, None]
    x[1] = 0.0
    x[2, 0] = 0.0
    x[2, 0, 3] = -3.0
    x[3, -1, :] = torch.arange(d) * 0.5 - 7.0
    x[3, -1, 0] = 448.0  # the scale is 1: the other values go through unscaled
    x[4, 0, 1] = float("nan")
    return x.to(dtype)


def empty_like_pages(values: torch.Tensor, rows_: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 buffer and its scales, filled with NaN (what is not written stays NaN)."""
    shape = (rows_, *values.shape[1:])
    dst = torch.full(shape, float("nan")).to(FP8_DTYPE)
    return dst, torch.full((*shape[:-1], 1), float("nan"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == FP8_DTYPE:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    else:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_and_v_in_one_launch_match_the_reference(dtype, monkeypatch):
    n, total = 9, 40
    k = rows(n, 3, 32, seed=1, dtype=dtype)
    v = rows(n, 2, 48, seed=2, dtype=dtype)  # other heads and width than K
    # a non-contiguous index: every other element of a permutation
    index = torch.randperm(total, generator=torch.Generator().manual_seed(3))[: 2 * n][::2]
    assert not index.is_contiguous()
    want = [(k, *empty_like_pages(k, total)), (v, *empty_like_pages(v, total))]
    got = [(k, *empty_like_pages(k, total)), (v, *empty_like_pages(v, total))]
    reference(index, want)
    launches = []
    real = triton_kv_quant.quantize_scatter
    monkeypatch.setattr(
        triton_kv_quant, "quantize_scatter", lambda *a: (launches.append(1), real(*a))
    )
    kernel(index, got)
    assert len(launches) == 1
    for (_, wq, ws), (_, gq, gs) in zip(want, got):
        assert same_bits(gq, wq) and same_bits(gs, ws)


def test_every_e4m3_value_and_every_rounding_tie_converts_as_torch_does():
    """Rows with 448 in them have scale 1, so the kernel's e4m3 conversion sees their values as
    they are: every e4m3 value, the midpoints between neighbours (ties to even) and the fp32
    values just either side, subnormals and signs included."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    up, down = mid.nextafter(torch.tensor(float("inf"))), mid.nextafter(torch.tensor(0.0))
    values = torch.cat([grid, mid, up, down, torch.tensor([1e-30, 2.0**-10, 2.0**-10 * 3])])
    values = torch.cat([values, -values])
    d = 64
    pad = (-values.numel()) % (d - 1)
    values = torch.cat([values, torch.zeros(pad)]).view(-1, 1, d - 1)
    x = torch.cat([torch.full((values.shape[0], 1, 1), FP8_MAX), values], dim=-1)
    index = torch.arange(x.shape[0])
    want, got = [(x, *empty_like_pages(x, x.shape[0]))], [(x, *empty_like_pages(x, x.shape[0]))]
    reference(index, want)
    kernel(index, got)
    assert torch.equal(want[0][2], torch.ones_like(want[0][2]))
    assert same_bits(got[0][1], want[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_gives_quantize_rows_bits(dtype):
    """The sliding rings' new rows (gemma4): quantized in place of the pass, K and V at once."""
    k, v = rows(6, 2, 16, seed=4, dtype=dtype), rows(6, 2, 16, seed=5, dtype=dtype)
    gpu.set_triton(True, on_cpu=True)
    got = quantize(k, v)
    gpu.set_triton(True)
    for (gq, gs), x in zip(got, (k, v)):
        wq, ws = quantize_rows(x)
        assert gq.dtype == FP8_DTYPE and gs.shape == ws.shape
        assert same_bits(gq, wq) and same_bits(gs, ws)


def test_a_latent_row_without_heads_and_an_empty_pass():
    """An MLA latent row [r] (scales [1]); a pass of no rows writes nothing."""
    x = rows(5, 1, 40, seed=6, dtype=torch.float32)[:, 0]
    index = torch.tensor([7, 1, 3, 0, 6])
    want, got = [(x, *empty_like_pages(x, 8))], [(x, *empty_like_pages(x, 8))]
    reference(index, want)
    kernel(index, got)
    assert same_bits(got[0][1], want[0][1]) and same_bits(got[0][2], want[0][2])
    kernel(index[:0], [(x[:0], got[0][1], got[0][2])])
    assert same_bits(got[0][1], want[0][1])


def test_paged_rows_write_k_and_v_through_the_kernel_as_through_torch(monkeypatch):
    specs = []
    for name in ("L0.k", "L0.v"):
        spec = RowSpec(name, (2, 16), FP8)
        specs += [spec, scale_spec(spec)]
    specs.append(RowSpec("L0.other", (4,), "float32"))
    index = torch.tensor([5, 2, 9, 11, 0])
    k, v = (
        rows(5, 2, 16, seed=7, dtype=torch.bfloat16),
        rows(5, 2, 16, seed=8, dtype=torch.bfloat16),
    )
    other = torch.randn(5, 4)
    out = []
    for on in (False, True):
        paged = PagedRows(specs, num_pages=3, page_rows=4)
        for buf in paged.buffers.values():
            buf.view(torch.uint8).fill_(0x7F)
        calls = []
        monkeypatch.setattr(
            kv_quant, "quantize_rows", lambda x, real=quantize_rows: (calls.append(1), real(x))[1]
        )
        gpu.set_triton(on, on_cpu=on)
        paged.write_many(index, [("L0.k", k), ("L0.v", v), ("L0.other", other)])
        gpu.set_triton(True)
        assert len(calls) == (0 if on else 2)
        out.append(paged.buffers)
    for name in out[0]:
        assert same_bits(out[1][name], out[0][name]), name
    assert torch.equal(out[1]["L0.other"][index], other)
