"""The ring kernel with media blocks on the GPU (`pytest -m gpu`), at Gemma 4's sliding-layer
shape (16 query heads, 8 KV heads of 256, window 1024, bf16; and fp8 rings): images of 280 and
1120 rows (the second longer than the window) inside long prompts, beside a decode row. The
kernel with `upto` against the torch reference; each stream alone, and its key segments shared
or walked, give the same bits; a prompt cut at an image's first row gives one pass's bits."""

from __future__ import annotations

import pytest
import torch

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops import triton_window
from tensorfold.ops import window_attention as ref_window
from tensorfold.ops.kv_quant import quantize_rows
from tensorfold.ops.pass_meta import build_meta

pytestmark = pytest.mark.gpu

DEV = "cuda"
HQ, HKV, D, W = 16, 8, 256, 1024
# slot, start, rows, blocks: a prompt from 0 with a 280-row image; a chunk resumed past the
# window holding a 1120-row image; a decode row deep in its context
RUNS = [(0, 0, 1500, ((700, 980),)), (1, 3000, 1400, ((3100, 4220),)), (2, 9000, 1, ())]


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HKV, D, generator=g).to(DEV, torch.bfloat16)


def _pass(runs) -> ForwardPass:
    streams = [
        StreamRows(slot, start, [0] * n, list(range(64 * slot, 64 * slot + 64)), "all", blocks=b)
        for slot, start, n, b in runs
    ]
    return ForwardPass(streams, 256, DEV)


def _history(runs):
    keys = [_rows(s + n, 10 + i) for i, (_, s, n, _) in enumerate(runs)]
    values = [_rows(s + n, 50 + i) for i, (_, s, n, _) in enumerate(runs)]
    ring_k = torch.full((3, W - 1, HKV, D), float("nan"), device=DEV, dtype=torch.bfloat16)
    ring_v = ring_k.clone()
    for (slot, start, _, _), k, v in zip(runs, keys, values):
        lo = max(0, start - W + 1)
        at = torch.arange(lo, start, device=DEV) % (W - 1)
        ring_k[slot, at], ring_v[slot, at] = k[lo:start], v[lo:start]
    return keys, values, ring_k, ring_v


def _kernel(q, k, v, ring_k, ring_v, fp, scales=None, parts=None):
    return triton_window.ring_attention(
        q,
        k,
        v,
        ring_k,
        ring_v,
        fp.positions,
        build_meta(fp),
        scale=D**-0.5,
        window=W,
        scales=scales,
        parts=parts,
        upto=fp.attend_upto,
        reach=ref_window.block_reach(fp),
    )


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_ring_kernel_with_image_blocks_at_gemma4_s_shape(fp8: bool) -> None:
    fp = _pass(RUNS)
    keys, values, ring_k, ring_v = _history(RUNS)
    k = torch.cat([r[s : s + n] for (_, s, n, _), r in zip(RUNS, keys)])
    v = torch.cat([r[s : s + n] for (_, s, n, _), r in zip(RUNS, values)])
    g = torch.Generator().manual_seed(99)
    q = torch.randn(fp.num_rows, HQ, D, generator=g).to(DEV, torch.bfloat16)
    scales = None
    if fp8:
        (k, ks), (v, vs) = quantize_rows(k), quantize_rows(v)
        (ring_k, rks), (ring_v, rvs) = quantize_rows(ring_k), quantize_rows(ring_v)
        scales = ref_window.RingScales(ks, vs, rks, rvs)
    got = _kernel(q, k, v, ring_k, ring_v, fp, scales)
    assert torch.isfinite(got).all()
    rows = ref_window.gather_window(ring_k, ring_v, k, v, fp, W)
    if scales is not None:
        s = ref_window.gather_window(rks, rvs, ks, vs, fp, W)
        rows = ref_window.WindowRows(
            rows.bases,
            [x.float() * y for x, y in zip(rows.keys, s.keys)],
            [x.float() * y for x, y in zip(rows.values, s.values)],
        )
    want = ref_window.window_attention(q, rows, fp, scale=D**-0.5, window=W, upto=fp.attend_upto)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, float(err)
    causal = ref_window.window_attention(q, rows, fp, scale=D**-0.5, window=W)
    assert not torch.equal(causal, want)  # the images' rows see ahead
    for parts in (1, 5):
        assert torch.equal(_kernel(q, k, v, ring_k, ring_v, fp, scales, parts), got), parts
    for i, run in enumerate(RUNS):
        a, z = fp.spans[i]
        alone = _pass([run])
        sub = None
        if scales is not None:
            sub = ref_window.RingScales(ks[a:z].clone(), vs[a:z].clone(), rks, rvs)
        out = _kernel(q[a:z].clone(), k[a:z].clone(), v[a:z].clone(), ring_k, ring_v, alone, sub)
        assert torch.equal(out, got[a:z]), i


def test_a_prompt_cut_at_its_image_gives_one_pass_s_bits() -> None:
    run = RUNS[0]
    keys, values, ring_k, ring_v = _history([run])
    g = torch.Generator().manual_seed(7)
    q = torch.randn(run[2], HQ, D, generator=g).to(DEV, torch.bfloat16)
    k, v = keys[0], values[0]
    whole = _kernel(q, k, v, ring_k, ring_v, _pass([run]))
    cut = run[3][0][0]
    head = _kernel(q[:cut], k[:cut], v[:cut], ring_k, ring_v, _pass([(0, 0, cut, ())]))
    lo = max(0, cut - W + 1)  # the head's rows the tail's window reaches, into the ring
    at = torch.arange(lo, cut, device=DEV) % (W - 1)
    ring_k[0, at], ring_v[0, at] = k[lo:cut], v[lo:cut]
    rest = [x[cut:].contiguous() for x in (q, k, v)]
    tail = _kernel(*rest, ring_k, ring_v, _pass([(0, cut, run[2] - cut, run[3])]))
    assert torch.equal(torch.cat([head, tail]), whole)
