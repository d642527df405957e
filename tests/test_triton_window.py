"""The sliding-window ring kernels (ops/triton_window.py) and the paged kernel at wide heads, on
the CPU under TRITON_INTERPRET=1 at small sizes, against the torch references: runs from 0 and
resumed past the window, runs shorter and longer than the window, several streams and decode rows
in one pass; a stream's bits alone equal its bits among others; NaN in ring rows outside the
window never leaks; the rings advance as the torch advance does. Then gemma4's GPU path on the
CPU: the demo model through the kernels against the torch path, and decode rounds through the
graph runner's static pass equal to plain rounds."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton")

from test_triton_kernels import _round_to_nearest_even, randn, rel  # noqa: E402, F401

from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import attention as ref_attention  # noqa: E402
from tensorfold.ops import triton_attention, triton_window  # noqa: E402
from tensorfold.ops import window_attention as ref_window  # noqa: E402
from tensorfold.ops.kv_quant import dequantize_rows, quantize_rows  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]
W = 20  # window: rings of 19 rows
SLOTS = 5
# slot, start, rows: a run from 0 longer than the window, a decode row resumed far past it, a
# run resumed past the window and shorter than it, a decode row inside the first window, a
# one-row prompt, a run resumed before the window fills that ends past it
RUNS = [(2, 0, 45), (0, 130, 1), (1, 71, 13), (3, 6, 1), (4, 0, 1)]


def _pass(runs, page_rows=16) -> ForwardPass:
    """runs: (slot, start, rows); a stream's pages are its slot's, pages 16*slot.. ."""
    streams = [
        StreamRows(slot, start, [0] * n, list(range(16 * slot, 16 * slot + 16)), "all")
        for slot, start, n in runs
    ]
    return ForwardPass(streams, page_rows)


def _history(runs, hkv, d, dv, dtype, seed):
    """Every stream's rows [0, end) [S][end, Hkv, D*], and rings holding each stream's rows
    [max(0, start-W+1), start) with NaN in every other ring row (stale, poisoned)."""
    keys = [randn(s + n, hkv, d, seed=seed + i, dtype=dtype) for i, (_, s, n) in enumerate(runs)]
    values = [
        randn(s + n, hkv, dv, seed=seed + 50 + i, dtype=dtype) for i, (_, s, n) in enumerate(runs)
    ]
    ring_k = torch.full((SLOTS, W - 1, hkv, d), float("nan"), dtype=dtype)
    ring_v = torch.full((SLOTS, W - 1, hkv, dv), float("nan"), dtype=dtype)
    for (slot, start, _), k, v in zip(runs, keys, values):
        for p in range(max(0, start - W + 1), start):
            ring_k[slot, p % (W - 1)], ring_v[slot, p % (W - 1)] = k[p], v[p]
    return keys, values, ring_k, ring_v


def _new_rows(runs, rows):
    return torch.cat([r[s : s + n] for (_, s, n), r in zip(runs, rows)])


def _case(runs, hq, hkv, d, dv, dtype, seed=0):
    fp = _pass(runs)
    keys, values, ring_k, ring_v = _history(runs, hkv, d, dv, dtype, seed)
    q = randn(fp.num_rows, hq, d, seed=seed + 99, dtype=dtype)
    return fp, q, _new_rows(runs, keys), _new_rows(runs, values), ring_k, ring_v, keys, values


def _ring_kernel(q, k, v, ring_k, ring_v, fp, window=W):
    return triton_window.ring_attention(
        q, k, v, ring_k, ring_v, fp.positions, build_meta(fp), scale=0.3, window=window
    )


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_ring_attention_matches_the_torch_rings_and_a_stream_alone(dtype, tol):
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, 6, 2, 16, 16, dtype)
    want = ref_window.window_attention(
        q, ref_window.gather_window(ring_k, ring_v, k, v, fp, W), fp, scale=0.3, window=W
    )
    got = _ring_kernel(q, k, v, ring_k, ring_v, fp)
    assert torch.isfinite(got).all()
    assert rel(got, want) < tol
    for i, run in enumerate(RUNS):
        alone = _pass([run])
        a, z = fp.spans[i]
        out = _ring_kernel(q[a:z].clone(), k[a:z].clone(), v[a:z].clone(), ring_k, ring_v, alone)
        assert torch.equal(out, got[a:z]), f"stream {i}"


@pytest.mark.parametrize("window", [1, 2, W])
def test_ring_attention_gives_the_paged_kernels_bits_with_the_same_window(window):
    """The same rows on pages (every row of every stream) and on rings: equal bits; the rings'
    rows outside the window are NaN and the pages' rows past each stream's end too."""
    runs = RUNS
    fp = _pass(runs)
    keys, values, _, _ = _history(runs, 2, 16, 16, torch.bfloat16, seed=3)
    ring_k = torch.full((SLOTS, window - 1, 2, 16), float("nan"), dtype=torch.bfloat16)
    ring_v = ring_k.clone()
    flat_k = torch.full((256 * SLOTS, 2, 16), float("nan"), dtype=torch.bfloat16)
    flat_v = flat_k.clone()
    for (slot, start, _), kk, vv in zip(runs, keys, values):
        at = slice(256 * slot, 256 * slot + len(kk))  # the slot's 16 pages of 16 rows
        flat_k[at], flat_v[at] = kk, vv
        for p in range(max(0, start - window + 1), start):
            ring_k[slot, p % (window - 1)], ring_v[slot, p % (window - 1)] = kk[p], vv[p]
    q = randn(fp.num_rows, 6, 16, seed=7, dtype=torch.bfloat16)
    paged = triton_attention.paged_attention(
        q, flat_k, flat_v, fp.positions, build_meta(fp), 16, scale=0.3, window=window
    )
    ring = _ring_kernel(
        q, _new_rows(runs, keys), _new_rows(runs, values), ring_k, ring_v, fp, window
    )
    assert torch.isfinite(ring).all()
    assert torch.equal(ring, paged)


@pytest.mark.parametrize(
    "d, group, dtype, tol",
    [
        (256, 2, torch.float32, 1e-5),
        (256, 8, torch.bfloat16, 2e-2),
        (512, 8, torch.bfloat16, 2e-2),
    ],
)
def test_wide_heads_in_both_kernels(d, group, dtype, tol):
    """Head dims 256 and 512 (chunked scores, output blocks), GQA up to 8: the paged kernel and
    the ring kernel against their torch references, and a decode row alone."""
    runs = [(0, 0, 21), (1, 40, 1), (2, 30, 3)]
    fp, q, k, v, ring_k, ring_v, keys, values = _case(runs, 2 * group, 2, d, d, dtype, seed=5)
    want = ref_window.window_attention(
        q, ref_window.gather_window(ring_k, ring_v, k, v, fp, W), fp, scale=0.3, window=W
    )
    got = _ring_kernel(q, k, v, ring_k, ring_v, fp)
    assert rel(got, want) < tol
    flat_k = torch.full((256 * SLOTS, 2, d), float("nan"), dtype=dtype)
    flat_v = flat_k.clone()
    for (slot, _, _), kk, vv in zip(runs, keys, values):
        at = slice(256 * slot, 256 * slot + len(kk))  # the slot's 16 pages of 16 rows
        flat_k[at], flat_v[at] = kk, vv
    paged = triton_attention.paged_attention(
        q, flat_k, flat_v, fp.positions, build_meta(fp), 16, scale=0.3
    )
    assert rel(paged, ref_attention.paged_attention(q, flat_k, flat_v, fp, scale=0.3)) < tol
    alone = _pass(runs[1:2])
    a, z = fp.spans[1]
    out = triton_attention.paged_attention(
        q[a:z].clone(), flat_k, flat_v, alone.positions, build_meta(alone), 16, scale=0.3
    )
    assert torch.equal(out, paged[a:z])


@pytest.mark.parametrize("window", [1, 2, W])
def test_rings_advance_as_the_torch_advance(window):
    runs = RUNS + [(5, 200, 3)]  # slot 5: pages 80..95
    fp = _pass(runs)
    new = randn(fp.num_rows, 2, 16, seed=9, dtype=torch.bfloat16)
    ring = torch.full((SLOTS + 1, window - 1, 2, 16), float("nan"), dtype=torch.bfloat16)
    ring[1, :3] = 1.0  # rows the pass leaves as they are
    want = ring.clone()
    ref_window.advance_rings(want, new, fp)
    triton_window.advance_rings(ring, new, fp.positions, build_meta(fp))
    assert torch.equal(ring.isnan(), want.isnan())
    assert torch.equal(ring.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_ring_attention_over_fp8_rows_matches_the_torch_rings_and_a_stream_alone(dtype, tol):
    """TF_KV_DTYPE=fp8: e4m3 rings and new rows with their scales (NaN in the rings' rows
    outside the windows, scales too)."""
    fp, q, k, v, ring_k, ring_v, _, _ = _case(RUNS, 6, 2, 16, 16, torch.float32, seed=11)
    q = q.to(dtype)
    (k, ks), (v, vs) = quantize_rows(k), quantize_rows(v)
    (ring_k, rks), (ring_v, rvs) = quantize_rows(ring_k), quantize_rows(ring_v)
    scales = ref_window.RingScales(ks, vs, rks, rvs)
    want = ref_window.ring_attention(
        q, k, v, ring_k, ring_v, fp, scale=0.3, window=W, scales=scales
    )
    # the reference over the same rows dequantized up front
    plain = ref_window.window_attention(
        q,
        ref_window.gather_window(
            dequantize_rows(ring_k, rks),
            dequantize_rows(ring_v, rvs),
            dequantize_rows(k, ks),
            dequantize_rows(v, vs),
            fp,
            W,
        ),
        fp,
        scale=0.3,
        window=W,
    )
    assert torch.equal(want, plain)
    got = triton_window.ring_attention(
        q, k, v, ring_k, ring_v, fp.positions, build_meta(fp), scale=0.3, window=W, scales=scales
    )
    assert torch.isfinite(got).all()
    assert rel(got, want) < tol
    for i, run in enumerate(RUNS):
        alone = _pass([run])
        a, z = fp.spans[i]
        out = triton_window.ring_attention(
            q[a:z].clone(),
            k[a:z].clone(),
            v[a:z].clone(),
            ring_k,
            ring_v,
            alone.positions,
            build_meta(alone),
            scale=0.3,
            window=W,
            scales=ref_window.RingScales(ks[a:z].clone(), vs[a:z].clone(), rks, rvs),
        )
        assert torch.equal(out, got[a:z]), f"stream {i}"


def test_fp8_rings_and_their_scales_advance_as_the_torch_advance():
    runs = RUNS + [(5, 200, 3)]
    fp = _pass(runs)
    new, scales = quantize_rows(randn(fp.num_rows, 2, 16, seed=12))
    for rows in (new, scales):
        ring = torch.full((SLOTS + 1, W - 1, *rows.shape[1:]), float("nan"), dtype=rows.dtype)
        want = ring.clone()
        ref_window.advance_rings(want, rows, fp)
        triton_window.advance_rings(ring, rows, fp.positions, build_meta(fp))
        assert torch.equal(ring.float().isnan(), want.float().isnan())
        assert torch.equal(ring.float().nan_to_num(), want.float().nan_to_num())


# --- gemma4's GPU path on the CPU ---


@pytest.fixture
def attention_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """Attention (paged and rings) takes its Triton kernels for CPU tensors, and the graph runner
    its decode buckets; the other ops stay on their torch paths (the interpreter is slow)."""
    from tensorfold.engine import cuda_graphs
    from tensorfold.ops import attention, window_attention

    for module in (attention, window_attention, cuda_graphs):
        monkeypatch.setattr(module, "use_triton", lambda t: True)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory):
    """The gemma4 demo checkpoint (window 128, KV-sharing layers) in fp32."""
    demo = pytest.importorskip("tensorfold_gemma4.demo")
    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold_gemma4.model import load

    path = demo.build_demo(tmp_path_factory.mktemp("gemma4_demo"))
    return load(Checkpoint.open(path), "cpu", "float32")


def _rounds(runner, prompts, decode_rounds, cut=None):
    """Prefill every prompt (in two passes cut at `cut`, or one), then greedy decode rounds;
    all logits, in order."""
    from tensorfold.engine.runner import open_stream

    streams = [open_stream(runner, i, 256) for i in range(len(prompts))]
    logits = []
    for a, b in ((0, cut), (cut, None)) if cut else ((0, None),):
        out = runner.run([s.rows(p[a:b], logits="all") for s, p in zip(streams, prompts)])
        logits.append(torch.cat(out))
    for _ in range(decode_rounds):
        nxt = [[int(o[-1].argmax())] for o in out]
        out = runner.run([s.rows(t) for s, t in zip(streams, nxt)])
        logits.append(torch.cat(out))
    return logits


def test_gemma4_through_the_kernels_matches_the_torch_path(
    demo_model, monkeypatch, attention_kernels_on_cpu
):
    """Prompts past the 128-row window, cut mid-window, then decode rounds: the sliding layers on
    the ring kernels (the KV-sharing layers reading their store layer's rings before it moves
    on) against the torch path; then the graph runner's decode rounds (its static pass's streams
    are placeholders: the layout comes from PassMeta) equal plain rounds bit for bit."""
    from tensorfold.engine import cuda_graphs
    from tensorfold.engine.cuda_graphs import GraphRunner
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.ops import attention, window_attention

    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(3, demo_model.vocab_size, (n,), generator=gen).tolist() for n in (135, 20)
    ]
    plain = _rounds(ModelRunner(demo_model, num_pages=4, num_slots=2), prompts, 2, cut=10)
    runner = GraphRunner(demo_model, num_pages=4, num_slots=2, max_pages=1)
    graphed = _rounds(runner, prompts, 2, cut=10)
    assert runner.replays == 2
    for g, p in zip(graphed, plain):
        assert torch.equal(g, p)
    for module in (attention, window_attention, cuda_graphs):
        monkeypatch.setattr(module, "use_triton", lambda t: False)
    want = _rounds(ModelRunner(demo_model, num_pages=4, num_slots=2), prompts, 2, cut=10)
    for g, w in zip(plain, want):
        assert rel(g, w) < 1e-4


def test_k_v_rings_and_their_scales_advance_in_one_launch_as_the_torch_advance(monkeypatch):
    """A sliding layer's four fp8 rings (K, V: e4m3 of other widths; their scales: float32
    [.., 1]) advanced together (window_attention.advance_many) as one by one in torch."""
    from tensorfold.ops import gpu

    runs = RUNS + [(5, 200, 3)]
    fp = _pass(runs)
    (k, ks), (v, vs) = (
        quantize_rows(randn(fp.num_rows, 2, 16, seed=13)),
        quantize_rows(randn(fp.num_rows, 3, 8, seed=14)),
    )
    news = [k, v, ks, vs]
    rings = [torch.full((SLOTS + 1, W - 1, *t.shape[1:]), float("nan")).to(t.dtype) for t in news]
    want = [r.clone() for r in rings]
    ref_window.advance_many(want, news, fp)
    launches = []
    real = triton_window._advance_kernel
    monkeypatch.setattr(
        triton_window,
        "_advance_kernel",
        type("K", (), {"__getitem__": lambda self, g: (launches.append(g), real[g])[1]})(),
    )
    gpu.set_triton(True, on_cpu=True)
    try:
        ref_window.advance_many(rings, news, fp)
    finally:
        gpu.set_triton(True)
    assert launches == [(fp.num_rows, 2 + 3 + 2 + 3)]
    for got, w in zip(rings, want):
        got, w = got.float(), w.float()
        assert torch.equal(got.isnan(), w.isnan()) and torch.equal(got.nan_to_num(), w.nan_to_num())
