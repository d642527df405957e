"""fp8 KV rows on the GPU in Triton: quantize a pass's new rows and scatter them, K and V
together, in one launch (the torch reference is kv_quant.quantize_rows + index_copy_rows, some
ten small kernels a buffer).

Bit for bit the reference's (as torch computes it on the CPU): per row r and head h of a
buffer, s = amax(|x|) / 448 (1 for a row whose amax is not > 0, a NaN row too), q = clamp(x / s,
±448) -> e4m3, both divisions IEEE-rounded (div_rn: Triton's `/` on fp32 is approximate on the
GPU). The e4m3 bits come from integer and fp32-add steps that mirror c10's
fp8e4m3fn_from_fp32_value (round to nearest even, subnormals included) instead of Triton's
conversion, whose interpreter rounds otherwise: so the bits the CPU tests check are the GPU's.
Elementwise per (row, head): no row depends on another.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .gpu import launch_options
from .triton_util import after_prior, next_power_of_2


@triton.jit
def _e4m3_bits(y):
    """fp32 y, |y| <= 448 or NaN -> e4m3fn bits as int32 (0..255)."""
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.where(nan, 0, a)
    # normal: round the mantissa to 3 bits, to nearest even, and rebias the exponent 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # below 2**-6: adding 2**14 (fp32 bits 141 << 23) rounds |y| to a multiple of 2**-9,
    # e4m3's subnormal step, to nearest even; the low bits are then the e4m3 bits
    sub = ((a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True)) - (141 << 23)
    bits = tl.where(a < (121 << 23), sub, normal)
    bits = tl.where(nan, 0x7F, bits)
    return bits | sign


@triton.jit
def _quantize_head(
    src, dst, scl, r, row, h, s_n, s_h, d_n, d_h, c_n, c_h, D: tl.constexpr, BD: tl.constexpr
):
    """Row r, head h of src [N, H, D] -> e4m3 bits at dst[row, h] (uint8), scale at scl[row, h]."""
    i = tl.arange(0, BD)
    m = i < D
    x = tl.load(src + r.to(tl.int64) * s_n + h * s_h + i, mask=m, other=0.0).to(tl.float32)
    ax = tl.abs(x)
    amax = tl.max(ax, 0)
    nan = tl.max((ax != ax).to(tl.int32), 0)  # torch's amax is NaN then: the scale is 1
    ok = (amax > 0.0) & (nan == 0)
    s = tl.where(ok, tl.math.div_rn(tl.where(ok, amax, 448.0), 448.0), 1.0)
    y = tl.math.div_rn(x, tl.zeros_like(x) + s)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
    q = _e4m3_bits(y)
    tl.store(dst + row * d_n + h * d_h + i, q.to(tl.uint8), mask=m)
    tl.store(scl + row * c_n + h * c_h, s)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _quant_kernel(
    index,
    s_i,
    n_rows,
    a_src,
    a_dst,
    a_scl,
    a_sn,
    a_sh,
    a_dn,
    a_dh,
    a_cn,
    a_ch,
    b_src,
    b_dst,
    b_scl,
    b_sn,
    b_sh,
    b_dn,
    b_dh,
    b_cn,
    b_ch,
    HA: tl.constexpr,
    DA: tl.constexpr,
    DB: tl.constexpr,
    BD: tl.constexpr,
    HAS_INDEX: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    r = tl.program_id(0)
    j = tl.program_id(1)
    if HAS_INDEX:
        row = tl.load(index + r.to(tl.int64) * s_i).to(tl.int64)
    else:
        row = r.to(tl.int64)
    if j < HA:
        _quantize_head(a_src, a_dst, a_scl, r, row, j, a_sn, a_sh, a_dn, a_dh, a_cn, a_ch, DA, BD)
    else:
        _quantize_head(
            b_src, b_dst, b_scl, r, row, j - HA, b_sn, b_sh, b_dn, b_dh, b_cn, b_ch, DB, BD
        )


def _heads(values: torch.Tensor, dst: torch.Tensor, scales: torch.Tensor):
    """values [N, *S, D], dst [R, *S, D] e4m3, scales [R, *S, 1] -> views [N, H, D] (last dim
    contiguous), [R, H, D] as uint8, [R, H]."""
    d, heads = values.shape[-1], math.prod(values.shape[1:-1])
    v = values.reshape(values.shape[0], heads, d)
    if v.stride(-1) != 1:
        v = v.contiguous()
    q = dst.view(torch.uint8).view(dst.shape[0], heads, d)
    s = scales.view(scales.shape[0], heads)
    assert q.stride(-1) == 1
    assert scales.dtype == torch.float32
    return v, q, s


def quantize_scatter(
    index: torch.Tensor | None, writes: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> None:
    """writes: one or two (values [N, *S, D], dst [R, *S, D] e4m3, scales [R, *S, 1] float32);
    each row i of values is quantized into dst[index[i]] with its scales at scales[index[i]]
    (index None: at row i), all in one launch."""
    assert 1 <= len(writes) <= 2
    parts = [_heads(*w) for w in writes]
    n = parts[0][0].shape[0]
    assert all(p[0].shape[0] == n for p in parts)
    if n == 0:
        return
    a = parts[0]
    b = parts[1] if len(parts) == 2 else a
    ha, hb = a[0].shape[1], (b[0].shape[1] if len(parts) == 2 else 0)
    da, db = a[0].shape[2], b[0].shape[2]
    idx = index if index is not None else a[0]
    args = []
    for v, q, s in (a, b):
        args += [
            v,
            q,
            s,
            v.stride(0),
            v.stride(1),
            q.stride(0),
            q.stride(1),
            s.stride(0),
            s.stride(1),
        ]
    bd = next_power_of_2(max(da, db))
    _quant_kernel[(n, ha + hb)](
        idx,
        index.stride(0) if index is not None else 0,
        n,
        *args,
        HA=ha,
        DA=da,
        DB=db,
        BD=bd,
        HAS_INDEX=index is not None,
        num_warps=4 if bd >= 512 else (2 if bd >= 128 else 1),
        **launch_options(a[0]),
    )
