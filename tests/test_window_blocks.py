"""Sliding-window attention with media blocks (ops/window_attention.py's `upto`, Gemma 4's
bidirectional image rows in its sliding layers): the torch reference against a plain masked
softmax; the ring kernel (ops/triton_window.py, TRITON_INTERPRET=1) against the reference, a
stream alone and its key segments shared (`combine`) giving the same bits; a prompt cut at a
block's start giving the bits of one pass; and without upto the block rows come out otherwise."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from test_triton_kernels import randn, rel  # noqa: E402

from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import triton_key_split, triton_window  # noqa: E402
from tensorfold.ops import window_attention as ref_window  # noqa: E402
from tensorfold.ops.kv_quant import quantize_rows  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402

W = 20  # window: rings of 19 rows
SLOTS = 3
HQ, HKV, D = 4, 2, 16
# slot, start, rows, blocks: a prompt from 0 with a block longer than the window that crosses a
# 64-key segment (its first rows see 27 rows ahead), a run resumed past the window holding two blocks, and
# a decode row
RUNS = [(0, 0, 90, ((52, 80),)), (1, 30, 40, ((33, 38), (50, 61))), (2, 90, 1, ())]


def _pass(runs) -> ForwardPass:
    streams = [
        StreamRows(slot, start, [0] * n, list(range(16 * slot, 16 * slot + 16)), "all", blocks=b)
        for slot, start, n, b in runs
    ]
    return ForwardPass(streams, 16)


def _history(runs, dtype, seed=0):
    """Each stream's rows [0, end) and rings holding rows [max(0, start-W+1), start), NaN in
    every other ring row."""
    keys = [randn(s + n, HKV, D, seed=seed + i, dtype=dtype) for i, (_, s, n, _) in enumerate(runs)]
    values = [
        randn(s + n, HKV, D, seed=seed + 50 + i, dtype=dtype) for i, (_, s, n, _) in enumerate(runs)
    ]
    ring_k = torch.full((SLOTS, W - 1, HKV, D), float("nan"), dtype=dtype)
    ring_v = ring_k.clone()
    for (slot, start, _, _), k, v in zip(runs, keys, values):
        for p in range(max(0, start - W + 1), start):
            ring_k[slot, p % (W - 1)], ring_v[slot, p % (W - 1)] = k[p], v[p]
    return keys, values, ring_k, ring_v


def _new(runs, rows):
    return torch.cat([r[s : s + n] for (_, s, n, _), r in zip(runs, rows)])


def _case(runs, dtype=torch.float32, seed=0):
    fp = _pass(runs)
    keys, values, ring_k, ring_v = _history(runs, dtype, seed)
    q = randn(fp.num_rows, HQ, D, seed=seed + 99, dtype=dtype)
    return fp, q, _new(runs, keys), _new(runs, values), ring_k, ring_v, keys, values


def _reference(q, new_k, new_v, ring_k, ring_v, fp, upto=None):
    return ref_window.ring_attention(
        q, new_k, new_v, ring_k, ring_v, fp, scale=0.3, window=W, upto=upto
    )


def _kernel(q, new_k, new_v, ring_k, ring_v, fp, upto=None, parts=None):
    """The ring kernel with fp's attend_upto (`upto` is the reference's argument: unread)."""
    return triton_window.ring_attention(
        q,
        new_k,
        new_v,
        ring_k,
        ring_v,
        fp.positions,
        build_meta(fp),
        scale=0.3,
        window=W,
        parts=parts,
        upto=fp.attend_upto,
        reach=ref_window.block_reach(fp),
    )


def test_upto_is_each_block_s_last_row():
    fp = _pass(RUNS)
    assert fp.attend_upto is not None
    upto = fp.attend_upto[: fp.spans[0][1]].tolist()
    assert upto[51] == 51 and upto[52] == upto[79] == 79 and upto[80] == 80
    assert ref_window.block_reach(fp) == 27


def test_the_reference_is_a_masked_softmax_over_the_window_and_the_block():
    fp, q, k, v, ring_k, ring_v, keys, values = _case(RUNS)
    got = _reference(q, k, v, ring_k, ring_v, fp, fp.attend_upto)
    assert fp.attend_upto is not None
    for (a, b), kk, vv in zip(fp.spans, keys, values):
        for r in range(a, b):
            t, up = int(fp.positions[r]), int(fp.attend_upto[r])
            lo = max(0, t - W + 1)
            kh = kk[lo : up + 1].repeat_interleave(HQ // HKV, dim=1)  # [T, HQ, D]
            vh = vv[lo : up + 1].repeat_interleave(HQ // HKV, dim=1)
            p = torch.softmax(torch.einsum("hd,thd->ht", q[r], kh) * 0.3, dim=-1)
            want = torch.einsum("ht,thd->hd", p, vh)
            assert rel(got[r], want) < 1e-5, r
    causal = _reference(q, k, v, ring_k, ring_v, fp)
    inside = fp.attend_upto != fp.positions
    assert rel(causal[~inside], got[~inside]) == 0
    assert rel(causal[inside], got[inside]) > 1e-2  # the blocks' rows see ahead: it matters


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_the_kernel_matches_the_reference_and_a_stream_alone(dtype, tol):
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, dtype, seed=3)
    want = _reference(q, k, v, ring_k, ring_v, fp, fp.attend_upto)
    got = _kernel(q, k, v, ring_k, ring_v, fp)
    assert torch.isfinite(got).all()
    assert rel(got, want) < tol
    for i, run in enumerate(RUNS):
        alone = _pass([run])
        a, z = fp.spans[i]
        out = _kernel(q[a:z].clone(), k[a:z].clone(), v[a:z].clone(), ring_k, ring_v, alone)
        assert torch.equal(out, got[a:z]), f"stream {i}"


def test_fp8_rings_with_blocks_match_the_reference():
    """TF_KV_DTYPE=fp8: e4m3 rings and new rows with their scales, image blocks and all."""
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, seed=9)
    (k, ks), (v, vs) = quantize_rows(k), quantize_rows(v)
    (ring_k, rks), (ring_v, rvs) = quantize_rows(ring_k), quantize_rows(ring_v)
    scales = ref_window.RingScales(ks, vs, rks, rvs)
    want = ref_window.ring_attention(
        q, k, v, ring_k, ring_v, fp, scale=0.3, window=W, scales=scales, upto=fp.attend_upto
    )
    got = triton_window.ring_attention(
        q,
        k,
        v,
        ring_k,
        ring_v,
        fp.positions,
        build_meta(fp),
        scale=0.3,
        window=W,
        scales=scales,
        upto=fp.attend_upto,
        reach=ref_window.block_reach(fp),
    )
    assert torch.isfinite(got).all()
    assert rel(got, want) < 1e-5
    causal = ref_window.ring_attention(
        q, k, v, ring_k, ring_v, fp, scale=0.3, window=W, scales=scales
    )
    assert rel(causal, want) > 1e-2


def test_shared_key_segments_give_the_walked_bits(monkeypatch):
    """Segments of one key tile: a block's rows reach several segments past their own."""
    monkeypatch.setattr(triton_key_split, "SEGMENT", 64)
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, torch.bfloat16, seed=5)
    walked = _kernel(q, k, v, ring_k, ring_v, fp, parts=1)
    for parts in (2, 3):
        assert torch.equal(_kernel(q, k, v, ring_k, ring_v, fp, parts=parts), walked), parts


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_a_prompt_cut_at_its_block_gives_the_bits_of_one_pass(path):
    """Stream 0 in one pass, then cut at its block's start (rows 52.. read rows 33..51 from its
    ring): equal bits, though the key tiles each row's query block walks differ."""
    run = RUNS[0]
    fp, q, k, v, ring_k, ring_v, keys, values = _case([run], seed=7)
    attend = _reference if path == "reference" else _kernel
    whole = attend(q, k, v, ring_k, ring_v, fp, fp.attend_upto)
    first, second = _pass([(0, 0, 52, ())]), _pass([(0, 52, 38, run[3])])
    head = attend(q[:52], k[:52], v[:52], ring_k, ring_v, first, first.attend_upto)
    for p in range(52):
        ring_k[0, p % (W - 1)], ring_v[0, p % (W - 1)] = keys[0][p], values[0][p]
    rest = [x[52:].clone() for x in (q, k, v)]
    tail = attend(*rest, ring_k, ring_v, second, second.attend_upto)
    assert torch.equal(torch.cat([head, tail]), whole)
