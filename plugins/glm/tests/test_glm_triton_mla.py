"""glm5_next's MLA and DSA indexer on their Triton kernels (triton_mla, triton_indexer), on the
CPU under TRITON_INTERPRET=1 at tiny sizes: each kernel against its torch reference (the CPU
path), with more complete pools than a query selects; the cached pool keys equal the reference's
and are written only at each completed pool's last row; the chosen pools equal the CPU masks; a
stream's bits alone equal its bits beside others, and a stream run in one pass equals the same
stream cut into passes anywhere (mid-pool too: its pool keys come from earlier passes); a
decode pass laid out as the CUDA graph runner's static pass equals the eager pass. Rows a stream
has not written hold NaN."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from types import SimpleNamespace  # noqa: E402
from typing import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.adapters.paged_kv import PagedRows  # noqa: E402
from tensorfold.engine.cuda_graphs import GraphRunner, _Graph  # noqa: E402
from tensorfold.family import RowSpec  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold.ops import gpu  # noqa: E402
from tensorfold.ops.kv_quant import dequantize_rows, quantize_rows  # noqa: E402
from tensorfold.ops.pass_meta import build_meta  # noqa: E402
from tensorfold_glm import indexer, mla, ops, triton_indexer, triton_mla  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.weights import IndexerWeights, MlaWeights  # noqa: E402

PAGE_ROWS, NUM_PAGES = 16, 18
CFG = GlmConfig(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    v_head_dim=16,
    kv_lora_rank=32,
    index_head_dim=16,
    index_n_heads=16,
    index_kpool=4,
    index_topk=8,
    layer_types=("indexed_attention",) * 2,
    indexer_types=("full", "shared"),
    mlp_layer_types=("dense",) * 2,
)  # a query keeps 2 of up to 13 complete pools
# slot, start, rows, pages: a fresh prompt, a decode row, a chunk from row 21, a 1-row prompt
MIXED = [
    (0, 0, 40, [7, 3, 9]),
    (1, 53, 1, [1, 5, 0, 4]),
    (2, 21, 30, [10, 12, 2, 11]),
    (3, 0, 1, [15]),
]
DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


@pytest.fixture(autouse=True, scope="module")
def _round_to_nearest_even() -> Iterator[None]:
    """The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest even, as torch does):
    give it the GPU's rounding (as tests/test_triton_kernels.py does)."""
    with testing.interpreter_rounds_like_the_gpu():
        yield


@pytest.fixture
def gpu_path() -> Iterator[None]:
    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True)


def cpu_path():
    """A context in which the ops take the torch reference again."""

    class _Cpu:
        def __enter__(self):
            gpu.set_triton(True)

        def __exit__(self, *exc):
            gpu.set_triton(True, on_cpu=True)

    return _Cpu()


def randn(*shape: int, seed: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def weights(dtype: torch.dtype, with_indexer: bool, seed: int) -> MlaWeights:
    c, heads, h = CFG, CFG.num_attention_heads, CFG.hidden_size
    qr, r, dn, di, ni = (
        c.q_lora_rank,
        c.kv_lora_rank,
        c.qk_nope_head_dim,
        c.index_head_dim,
        c.index_n_heads,
    )

    def w(*shape: int, k: int, scale: float = 0.3, base: float = 0.0) -> torch.Tensor:
        return (base + randn(*shape, seed=seed * 100 + k, scale=scale)).to(dtype)

    idx = IndexerWeights(
        wq_b=w(ni * di, qr, k=1),
        wk=w(di, h, k=2),
        k_norm=w(di, k=3, scale=0.1, base=1.0),
        k_bias=w(di, k=4, scale=0.1),
        weights_proj=w(ni, h, k=5),
        ape=w(c.index_kpool, di, k=6),
        gate=w(di, h, k=7),
    )
    return MlaWeights(
        q_a=w(qr, h, k=8),
        q_a_bias=None,
        q_a_norm=w(qr, k=9, scale=0.1, base=1.0),
        q_b=w(heads * dn, qr, k=10),
        kv_a=w(r, h, k=11),
        kv_a_bias=None,
        kv_a_norm=w(r, k=12, scale=0.1, base=1.0),
        w_uk=w(heads, r, dn, k=13),
        w_uv=w(heads, c.v_head_dim, r, k=14),
        o=w(h, heads * c.v_head_dim, k=15),
        o_bias=None,
        indexer=idx if with_indexer else None,
    )


def make_pass(specs, tokens_seed: int = 0) -> ForwardPass:
    return ForwardPass([StreamRows(s, a, [1] * n, p, "all") for s, a, n, p in specs], PAGE_ROWS)


def filled_rows(dtype: torch.dtype, specs, ape: torch.Tensor | None = None) -> PagedRows:
    """Paged rows holding NaN, but random rows at positions [0, start) of each stream (written
    by earlier passes), and the pool keys of the pools they complete (by the GPU kernel, with
    ape: the L0 layer's by default). Rows of a pass are written by the layer itself."""
    d = str(dtype).removeprefix("torch.")
    c = CFG
    rows = PagedRows(
        [
            RowSpec("L0.latent", (c.kv_lora_rank,), d),
            RowSpec("L0.index_k", (c.index_head_dim,), d),
            RowSpec("L0.index_gate", (c.index_head_dim,), d),
            RowSpec("L0.pool_key", (c.index_head_dim,), d),
            RowSpec("L1.latent", (c.kv_lora_rank,), d),
        ],
        NUM_PAGES,
        PAGE_ROWS,
    )
    for buf in rows.buffers.values():
        buf.fill_(float("nan"))
    for slot, start, _, pages in specs:
        if start:
            hist = ForwardPass([StreamRows(slot, 0, [1] * start, pages)], PAGE_ROWS)
            for k, name in enumerate(rows.buffers):
                if name == "L0.pool_key":
                    continue
                shape = rows.buffers[name].shape[1:]
                rows.write(name, hist.write_index, randn(start, *shape, seed=50 + 7 * slot + k))
    history = [(slot, 0, start, pages) for slot, start, _, pages in specs if start]
    if history:
        hist = make_pass(history)
        triton_indexer.write_pool_keys(
            rows.flat("L0.index_k"),
            rows.flat("L0.index_gate"),
            weights(dtype, True, 1).indexer.ape if ape is None else ape,
            rows.flat("L0.pool_key"),
            hist.positions,
            hist.write_index,
            build_meta(hist),
            PAGE_ROWS,
        )
    return rows


def clone(rows: PagedRows) -> PagedRows:
    out = PagedRows(list(rows.specs.values()), rows.num_pages, rows.page_rows)
    out.buffers = {k: v.clone() for k, v in rows.buffers.items()}
    return out


def two_layers(dtype, fp, rows, x):
    """The full-indexer layer, then the shared one: (y0, y1, selection)."""
    y0, sel = mla.mla(CFG, "L0", weights(dtype, True, 1), x, fp, rows, None)
    y1, _ = mla.mla(CFG, "L1", weights(dtype, False, 2), x, fp, rows, sel)
    return y0, y1, sel


def masks_of(sel: torch.Tensor, fp: ForwardPass) -> list[torch.Tensor]:
    """The GPU selection as the CPU path's per-stream [rows, end] masks."""
    kp, out = CFG.index_kpool, []
    for s, (lo, hi) in zip(fp.streams, fp.spans):
        pools = s.end // kp
        chosen = torch.zeros(hi - lo, pools, dtype=torch.bool)
        for r in range(hi - lo):
            for p in sel[lo + r].tolist():
                if p >= 0:
                    chosen[r, p] = True
        out.append(indexer.token_mask(chosen, fp.positions[lo:hi], s.end, kp))
    return out


# --- the kernels against their references ---


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_layer_norm_and_head_linear_kernels(dtype, tol):
    x = randn(37, 16, seed=1, dtype=dtype, scale=2.0) + 0.5
    w, b = randn(16, seed=2, dtype=dtype) + 1, randn(16, seed=3, dtype=dtype)
    got = triton_indexer.layer_norm(x, w, b, 1e-6)
    assert got.dtype == dtype and rel(got, ops.layer_norm(x, w, b, 1e-6)) < tol / 10
    assert torch.equal(triton_indexer.layer_norm(x[5:6].clone(), w, b, 1e-6), got[5:6])
    wide = torch.cat([randn(37, 8, seed=9, dtype=dtype), x], dim=1)  # x's columns strided
    assert torch.equal(triton_indexer.layer_norm(wide[:, 8:], w, b, 1e-6), got)
    q = randn(70, 4, 48, seed=4, dtype=dtype)
    hw = randn(4, 80, 48, seed=5, dtype=dtype, scale=0.2)
    got = triton_mla.head_linear(q, hw)
    assert got.dtype == dtype and got.shape == (70, 4, 80)
    assert rel(got, ops.head_linear(q.double(), hw.double())) < tol
    for a, z in [(0, 1), (5, 22), (69, 70)]:
        assert torch.equal(triton_mla.head_linear(q[a:z].clone(), hw), got[a:z])


def _scores_of(keys: torch.Tensor) -> torch.Tensor:
    """The fp32 scores inside pool_key_scores' keys (NaN where no candidate)."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return torch.where(keys == triton_indexer.NO_POOL, float("nan"), bits.view(torch.float32))


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_pool_keys_and_scores_kernels_match_the_reference(dtype, tol):
    fp = make_pass(MIXED)
    di, ni, kp = CFG.index_head_dim, CFG.index_n_heads, CFG.index_kpool
    ape = randn(kp, di, seed=8, dtype=dtype)
    # every row written, and the keys of every complete pool cached by write_pool_keys
    rows = filled_rows(dtype, [(s, a + n, 0, p) for s, a, n, p in MIXED], ape)
    q = randn(fp.num_rows, ni, di, seed=6, dtype=dtype)
    wts = randn(fp.num_rows, ni, seed=7)
    kb, gb, pk = rows.flat("L0.index_k"), rows.flat("L0.index_gate"), rows.flat("L0.pool_key")
    keys = triton_indexer.pool_key_scores(
        q, wts, pk, kp, fp.positions, build_meta(fp), PAGE_ROWS, 16, di**-0.5
    )
    got = _scores_of(keys)
    written = torch.zeros(pk.shape[0], dtype=torch.bool)
    for i, (s, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        pools = s.end // kp
        idx = fp.read_index(i)[: pools * kp]
        pooled = indexer.pool_keys(kb[idx].view(pools, kp, di), gb[idx].view(pools, kp, di), ape)
        ends = idx.view(pools, kp)[:, -1]  # each pool's key sits at its last row
        written[ends] = True
        assert pk[ends].dtype == dtype and rel(pk[ends], pooled) < tol / 10
        want = indexer.pool_scores(q[lo:hi].float(), wts[lo:hi], pooled.float(), di**-0.5)
        cand = indexer.candidates(pools, fp.positions[lo:hi], kp)
        assert torch.equal(~got[lo:hi, :pools].isnan(), cand) and got[lo:hi, pools:].isnan().all()
        if cand.any():
            assert rel(got[lo:hi, :pools][cand], want[cand]) < tol
    assert torch.equal(~pk.isnan().any(-1), written)  # no other row was written
    # the head weights as the GPU path passes them, a bf16 column slice scaled in the launch:
    # the keys of the CPU path's `weights.float() * scale`
    head_w = randn(fp.num_rows, ni + 5, seed=9, dtype=torch.bfloat16)[:, 5:]
    args = (pk, kp, fp.positions, build_meta(fp), PAGE_ROWS, 16, di**-0.5)
    assert torch.equal(
        triton_indexer.pool_key_scores(q, head_w, *args, ni**-0.5),
        triton_indexer.pool_key_scores(q, head_w.float() * ni**-0.5, *args),
    )
    # a pool's key has the same bits written by any pass: here one row of a pass at a time
    again = clone(rows)
    again.flat("L0.pool_key").fill_(float("nan"))
    for slot, a, n, pages in MIXED:
        for t in range(kp - 1, a + n, kp):
            one = make_pass([(slot, t, 1, pages)])
            triton_indexer.write_pool_keys(
                kb,
                gb,
                ape,
                again.flat("L0.pool_key"),
                one.positions,
                one.write_index,
                build_meta(one),
                PAGE_ROWS,
            )
    assert torch.equal(again.flat("L0.pool_key").nan_to_num(7.0), pk.nan_to_num(7.0))


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_sparse_mla_kernel_matches_the_reference(dtype, tol):
    fp = make_pass(MIXED)
    rows = filled_rows(dtype, [(s, a + n, 0, p) for s, a, n, p in MIXED])
    latent = rows.flat("L0.latent")
    heads, r = CFG.num_attention_heads, CFG.kv_lora_rank
    q = randn(fp.num_rows, heads, r, seed=9, dtype=dtype)
    # a selection: some of the complete pools before each query, ascending, -1 padded
    g = torch.Generator().manual_seed(10)
    sel = torch.full((fp.num_rows, 3), -1, dtype=torch.int32)
    for row, t in enumerate(fp.positions.tolist()):
        pools = (t + 1) // CFG.index_kpool
        pick = torch.randperm(pools, generator=g)[:3].sort().values
        sel[row, : len(pick)] = pick.to(torch.int32)
    got = triton_mla.sparse_mla(
        q, latent, sel, fp.positions, build_meta(fp), PAGE_ROWS, CFG.index_kpool, 0.25
    )
    assert not got.isnan().any()
    for i, (lo, hi) in enumerate(fp.spans):
        keys = latent.index_select(0, fp.read_index(i)).float()
        want = mla.sparse_attention(q[lo:hi].float(), keys, masks_of(sel, fp)[i], 0.25)
        assert rel(got[lo:hi], want) < tol


@pytest.mark.parametrize("dtype, tol", DTYPES)
def test_sparse_mla_kernel_over_fp8_latent_rows_matches_the_reference(dtype, tol):
    """TF_KV_DTYPE=fp8: e4m3 latent rows and their scales (NaN where no stream wrote), read by
    the kernel and by the reference alike; the reference folds the scales in as dequantizing
    up front would."""
    fp = make_pass(MIXED)
    heads, r = CFG.num_attention_heads, CFG.kv_lora_rank
    latent, scales = quantize_rows(randn(NUM_PAGES * PAGE_ROWS, r, seed=31, scale=4.0))
    written = torch.zeros(NUM_PAGES * PAGE_ROWS, dtype=torch.bool)
    written[fp.read_index(0)] = True
    for i in range(1, len(fp.spans)):
        written[fp.read_index(i)] = True
    unwritten = (~written).nonzero().flatten()
    latent[unwritten], scales[unwritten] = float("nan"), float("nan")
    q = randn(fp.num_rows, heads, r, seed=32, dtype=dtype)
    g = torch.Generator().manual_seed(33)
    sel = torch.full((fp.num_rows, 3), -1, dtype=torch.int32)
    for row, t in enumerate(fp.positions.tolist()):
        pick = torch.randperm((t + 1) // CFG.index_kpool, generator=g)[:3].sort().values
        sel[row, : len(pick)] = pick.to(torch.int32)
    got = triton_mla.sparse_mla(
        q, latent, sel, fp.positions, build_meta(fp), PAGE_ROWS, CFG.index_kpool, 0.25, scales
    )
    assert not got.isnan().any()
    for i, (lo, hi) in enumerate(fp.spans):
        idx = fp.read_index(i)
        keys, key_scales = latent.index_select(0, idx).float(), scales.index_select(0, idx)[:, 0]
        want = mla.sparse_attention(q[lo:hi].float(), keys, masks_of(sel, fp)[i], 0.25, key_scales)
        plain = mla.sparse_attention(
            q[lo:hi].float(),
            dequantize_rows(latent.index_select(0, idx), scales.index_select(0, idx)),
            masks_of(sel, fp)[i],
            0.25,
        )
        assert rel(want, plain) < 1e-6
        assert rel(got[lo:hi], want) < tol


# --- the layers on the GPU path ---


def test_layers_match_the_cpu_path_and_select_the_same_pools(gpu_path):
    fp = make_pass(MIXED)
    rows = filled_rows(torch.float32, MIXED)
    x = randn(fp.num_rows, CFG.hidden_size, seed=11)
    with cpu_path():
        ref_rows = clone(rows)
        want0, want1, masks = two_layers(torch.float32, fp, ref_rows, x)
    got0, got1, sel = two_layers(torch.float32, fp, rows, x)
    assert sel.dtype == torch.int32 and sel.shape[1] == CFG.select_pools
    sparse = 0
    for i, (s, (lo, hi)) in enumerate(zip(fp.streams, fp.spans)):
        assert torch.equal(masks_of(sel, fp)[i], masks[i]), f"stream {i}"
        complete = (fp.positions[lo:hi] + 1) // CFG.index_kpool
        sparse += int((complete > CFG.select_pools).sum())
    assert sparse > 40  # most rows choose among more pools than they keep
    assert rel(got0, want0) < 1e-5 and rel(got1, want1) < 1e-5
    for name in ("L0.latent", "L0.index_k", "L1.latent"):  # nothing past the pass was written
        assert torch.equal(rows.flat(name).isnan(), ref_rows.flat(name).isnan())
    # the GPU path cached the key of each pool the pass completed, at the pool's last row only
    keys = rows.flat("L0.pool_key")
    new = keys.isnan().any(-1) != ref_rows.flat("L0.pool_key").isnan().any(-1)
    ends = fp.write_index[(fp.positions + 1) % CFG.index_kpool == 0]
    assert new.nonzero().flatten().tolist() == sorted(ends.tolist()) and len(ends) > 10


def test_a_stream_cut_into_passes_anywhere_gives_the_bits_of_one_pass(gpu_path):
    """48 rows (12 pools, 2 kept) in one pass, then cut at pool boundaries, mid-pool and into
    single rows: a pool's key is computed by whichever pass writes its last row, and every
    output, selection and row keeps its bits."""
    dtype, slot, pages = torch.bfloat16, 0, [7, 3, 9]
    x = randn(48, CFG.hidden_size, seed=14, dtype=dtype)
    whole = make_pass([(slot, 0, 48, pages)])
    ref_rows = filled_rows(dtype, [])
    want0, want1, want_sel = two_layers(dtype, whole, ref_rows, x)
    for cuts in [(0, 8, 48), (0, 6, 19, 20, 21, 30, 31, 32, 33, 48), (0, 1, 2, 3, 4, 5, 27, 48)]:
        rows = filled_rows(dtype, [])
        for a, b in zip(cuts, cuts[1:]):
            part = make_pass([(slot, a, b - a, pages)])
            y0, y1, sel = two_layers(dtype, part, rows, x[a:b].clone())
            assert torch.equal(y0, want0[a:b]) and torch.equal(y1, want1[a:b]), (cuts, a)
            for r in range(b - a):
                assert set(sel[r].tolist()) - {-1} == set(want_sel[a + r].tolist()) - {-1}
        for name, buf in rows.buffers.items():
            assert torch.equal(buf.nan_to_num(7.0), ref_rows.buffers[name].nan_to_num(7.0)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stream_alone_gives_the_bits_it_gives_among_others(gpu_path, dtype):
    fp = make_pass(MIXED)
    base = filled_rows(dtype, MIXED)
    x = randn(fp.num_rows, CFG.hidden_size, seed=12, dtype=dtype)
    y0, y1, sel = two_layers(dtype, fp, clone(base), x)
    assert not y1.isnan().any()
    for i, (lo, hi) in enumerate(fp.spans):
        alone = make_pass([MIXED[i]])
        a0, a1, asel = two_layers(dtype, alone, clone(base), x[lo:hi].clone())
        assert torch.equal(a0, y0[lo:hi]) and torch.equal(a1, y1[lo:hi]), f"stream {i}"
        for r in range(hi - lo):
            assert set(asel[r].tolist()) - {-1} == set(sel[lo + r].tolist()) - {-1}


@pytest.mark.parametrize("rows_each", [1, 3], ids=["decode", "verify"])
def test_a_pass_laid_out_as_the_graph_runners_equals_the_eager_pass(gpu_path, rows_each):
    """A decode pass (one row a stream) or a uniform verify pass (3 rows a stream, tapped at
    each draft row) through GraphRunner's static pass (placeholder host streams, its pool count
    from the page-table width) and its input fill, a bucket of 4 for 3 streams: each row's
    outputs and selection are the eager pass's (its pools counted from the streams' ends)."""
    dtype, r = torch.bfloat16, rows_each
    decode = [(1, 53, r, [1, 5, 0, 4]), (0, 40, r, [7, 3, 9]), (2, 17, r, [10, 12])]
    base = filled_rows(dtype, decode)
    x = randn(4 * r, CFG.hidden_size, seed=13, dtype=dtype)  # the 4th stream: the padding
    eager = make_pass(decode)
    assert eager.rows_each is None  # no taps: the eager plan, pools from the streams' ends
    want = two_layers(dtype, eager, clone(base), x[: 3 * r].clone())
    # GraphRunner's own static pass and input fill, on a stand-in for the runner
    bucket, max_pages, scratch = 4, 5, NUM_PAGES - 1
    ns = SimpleNamespace(
        pool=SimpleNamespace(page_rows=PAGE_ROWS),
        scratch_page=scratch,
        scratch_slot=9,
        model=SimpleNamespace(device=torch.device("cpu")),
        _copied=None,
    )
    ns._pad = lambda g, a: GraphRunner._pad(ns, g, a)
    host = torch.empty(3 * bucket * r + (2 + max_pages) * bucket, dtype=torch.int64)
    g = _Graph(bucket, r, None, host, host.clone(), np=host.numpy())  # type: ignore[arg-type]
    ns._pad(g, 0)
    g.dev.copy_(host)
    g.fp = GraphRunner._static_pass(ns, g)
    assert g.fp.rows_each == (r if r > 1 else None)
    streams = [
        StreamRows(s, a, [1] * n, p, "all" if r > 1 else "last", range(a + 1, a + n), r > 1)
        for s, a, n, p in decode
    ]
    GraphRunner._fill(ns, g, streams, max(len(s.pages) for s in streams))
    got = two_layers(dtype, g.fp, clone(base), x)
    for w, o in zip(want[:2], got[:2]):
        assert torch.equal(o[: 3 * r], w)
    for row in range(3 * r):
        assert set(got[2][row].tolist()) - {-1} == set(want[2][row].tolist()) - {-1}


@pytest.mark.parametrize(
    "width, limit, one_launch_max",
    [
        (40, 16, 0),
        (9, 16, 0),
        (300, 128, 0),  # torch's top k, the sort in one launch
        (40, 16, 2048),
        (9, 16, 2048),
        (300, 128, 2048),
        (128, 128, 2048),  # all in one launch
    ],
)
def test_top_pools_in_one_launch_equal_torchs_sort(width, limit, one_launch_max, monkeypatch):
    gen = torch.Generator().manual_seed(width)
    keys = torch.randint(-(2**62), 2**62, (5, width), generator=gen, dtype=torch.int64)
    # the pool in the low bits, as pool_key_scores writes it
    keys = keys // 2**32 * 2**32 + (triton_indexer.LOW - torch.arange(width))
    keys[1, width // 3 :] = triton_indexer.NO_POOL  # fewer candidates than the limit
    keys[3] = triton_indexer.NO_POOL
    monkeypatch.setattr(triton_indexer, "ONE_LAUNCH_MAX_POOLS", one_launch_max)
    got = triton_indexer.top_pools(keys, limit)
    # torch's top k and sort: the chosen pools ascending, no-pools (== width) last, then -1
    best = torch.topk(keys, min(limit, width), dim=1, sorted=False).values
    pool = triton_indexer.LOW - (best & triton_indexer.LOW)
    pool = torch.where(best == triton_indexer.NO_POOL, torch.full_like(pool, width), pool)
    pool = torch.sort(pool, dim=1).values
    want = torch.where(pool == width, torch.full_like(pool, -1), pool).to(torch.int32)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (got[3] == -1).all() and (got[1, width // 3 :] == -1).all()
