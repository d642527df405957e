"""Attention's keys in segments (ops/triton_key_split.py), on the CPU under TRITON_INTERPRET=1:
one program walking a row's segments and several programs sharing them (then `combine`) give
the same bits, for the paged kernel (with and without a window, bf16 and fp8 rows) and the ring
kernel; a stream alone, split its own way, gives its bits among others; both agree with the
torch references. Segments of one key tile (64 keys) make a few hundred keys several segments."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from test_triton_kernels import _pass, randn, rel  # noqa: E402
from test_triton_window import RUNS, W, _case  # noqa: E402
from test_triton_window import _pass as _ring_pass  # noqa: E402

from tensorfold.family.forward_pass import ForwardPass  # noqa: E402
from tensorfold.ops import attention as ref_attention  # noqa: E402
from tensorfold.ops import triton_attention, triton_key_split, triton_window  # noqa: E402
from tensorfold.ops import window_attention as ref_window  # noqa: E402
from tensorfold.ops.kv_quant import quantize_rows  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402

PAGE_ROWS = 16
# slot, start, rows, pages: a decode row deep in its context, a chunk that crosses a segment's
# end, a fresh prompt longer than a segment, a decode row in the first segment
LONG = [
    (0, 300, 1, list(range(0, 20))),
    (1, 120, 12, list(range(20, 29))),
    (2, 0, 70, list(range(29, 34))),
    (3, 9, 1, [34]),
]


@pytest.fixture
def one_tile_segments(monkeypatch):
    monkeypatch.setattr(triton_key_split, "SEGMENT", 64)


def _paged(q, k, v, fp, window, parts, **scales):
    return triton_attention.paged_attention(
        q,
        k,
        v,
        fp.positions,
        build_meta(fp),
        PAGE_ROWS,
        scale=0.25,
        window=window,
        parts=parts,
        **scales,
    )


@pytest.mark.parametrize(
    "dtype, tol, fp8, window",
    [
        (torch.float32, 1e-5, False, None),
        (torch.bfloat16, 2e-2, False, 100),
        (torch.bfloat16, 2e-2, True, 100),
    ],
)
def test_paged_segments_walked_or_shared_give_the_same_bits(
    one_tile_segments, dtype, tol, fp8, window
):
    fp = _pass(LONG, PAGE_ROWS)
    hkv, group, d = 2, 3, 16
    k = randn(35 * PAGE_ROWS, hkv, d, seed=1, dtype=dtype)
    v = randn(35 * PAGE_ROWS, hkv, d, seed=2, dtype=dtype)
    scales = {}
    if fp8:
        (k, ks), (v, vs) = quantize_rows(k.float()), quantize_rows(v.float())
        scales = {"k_scales": ks, "v_scales": vs}
    q = randn(fp.num_rows, hkv * group, d, seed=3, dtype=dtype)
    walked = _paged(q, k, v, fp, window, 1, **scales)
    want = ref_attention.paged_attention(q, k, v, fp, scale=0.25, window=window, **scales)
    assert rel(walked, want) < tol
    for parts in (3, None):
        assert torch.equal(_paged(q, k, v, fp, window, parts, **scales), walked), parts
    for i in range(len(LONG)):
        alone = ForwardPass([fp.streams[i]], PAGE_ROWS)
        a, z = fp.spans[i]
        out = _paged(q[a:z].clone(), k, v, alone, window, None, **scales)
        assert torch.equal(out, walked[a:z]), f"stream {i}"


def test_split_choice_follows_the_pass_size():
    assert triton_key_split.parts_for(264, 100) == 1  # enough programs already
    assert triton_key_split.parts_for(100, 100) == 1  # a split of 3 would not pay for its combine
    assert triton_key_split.parts_for(66, 100) == 4
    assert triton_key_split.parts_for(2, 1) == 1  # one segment: nothing to share
    assert triton_key_split.parts_for(2, 100) == 100  # 132 wanted, 100 segments to share
    assert triton_key_split.parts_for(8, 200) == 33
    # a decode row fills one of its block's parts: 64 one-row blocks of wide heads (8 parts)
    assert triton_key_split.live_tiles(64, 8, 64, 2) == 96
    assert triton_key_split.live_tiles(1, 1, 16, 16) == 1


def test_ring_segments_walked_or_shared_give_the_same_bits(one_tile_segments):
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, 6, 2, 16, 16, torch.bfloat16)
    meta = build_meta(fp)

    def ring(parts, fp=fp, q=q, k=k, v=v, meta=meta):
        return triton_window.ring_attention(
            q, k, v, ring_k, ring_v, fp.positions, meta, scale=0.3, window=W, parts=parts
        )

    walked = ring(1)
    want = ref_window.window_attention(
        q, ref_window.gather_window(ring_k, ring_v, k, v, fp, W), fp, scale=0.3, window=W
    )
    assert torch.isfinite(walked).all()
    assert rel(walked, want) < 2e-2
    for parts in (2, 3, None):
        assert torch.equal(ring(parts), walked), parts
    for i, run in enumerate(RUNS):
        alone = _ring_pass([run])
        a, z = fp.spans[i]
        out = ring(None, alone, q[a:z].clone(), k[a:z].clone(), v[a:z].clone(), build_meta(alone))
        assert torch.equal(out, walked[a:z]), f"stream {i}"
