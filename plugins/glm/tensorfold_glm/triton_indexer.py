"""The DSA indexer on the GPU in Triton; indexer.py (the CPU path) is its torch reference.

`layer_norm`: the indexer keys' LayerNorm, one row per program slot, each row reducing only its
own elements. `select_pools`: per query row, the best select_pools complete pools that end at or
before it, as int32 pool indices in ascending order, -1 padded at the end: [N, W'] with
W' = min(select_pools, W). The tail (the (t + 1) mod kpool rows of t's own incomplete pool) is
implied by the position and not listed.

Pool keys (`write_pool_keys`): once per pool, by the pass that writes its last row (position
kpool·p + kpool - 1), K_p is rebuilt from the stream's paged rows exactly as `indexer.pool_keys`
(softmax over the pool's tokens per channel, weights rounded to the keys' dtype before the
product, the sum in token order), rounded to the keys' dtype (the dtype the scores multiply it
in), and stored in the `{name}.pool_key` paged row at that last row. Every pool's key comes from
the same code on the same rows, so it has the same bits whichever pass wrote it.

Scoring (`_score_kernel`): a program takes one attention query block of meta (up to QUERY_ROWS
rows of one stream) and a tile of POOL_TILE pools. It loads each complete pool's cached key and
scores I(t, p) = Σ_h w_h relu(q_h · K_p · scale), heads in order. Only pools whose last row is
at or before the block's last query are loaded: keys written by this pass or an earlier one,
never a row the stream has not written.

Selection: each (query, pool) gets a unique int64 key, the score's order-preserving bits above
the inverted pool index (higher score first, then the earlier pool: the CPU path's tie rule);
non-candidates get INT64_MIN. The top select_pools keys of a row are a set fixed by the row's
scores alone, so torch.topk over any width (no host sync) picks the same pools the CPU path does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tensorfold.ops.gpu import launch_options
from tensorfold.ops.pass_meta import QUERY_ROWS, PassMeta
from tensorfold.ops.triton_util import after_prior, cdiv, interpreting, mma, next_power_of_2

POOL_TILE = 32  # pools scored per program
NO_POOL = -(2**63)  # the key of a non-candidate
LOW = 2**32 - 1
ONE_LAUNCH_MAX_POOLS = 2048  # top_pools in one launch up to this many pools a row


@triton.jit(do_not_specialize=["n_rows"])  # one binary for any row count
def _layer_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    o_ptr,
    n_rows,
    D,
    stride_x,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    mean = tl.sum(x, axis=1) / D
    centred = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / D
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    out = centred * tl.math.rsqrt(var + eps)[:, None] * w[None, :] + b[None, :]
    tl.store(o_ptr + offs, out.to(o_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension in fp32, rounded to x's dtype. x [..., D] (2-D rows
    may be strided: a slice of a wider product's columns); weight, bias [D] -> contiguous."""
    d = x.shape[-1]
    rows = x if x.dim() == 2 and x.stride(1) == 1 else x.reshape(-1, d).contiguous()
    n = rows.shape[0]
    out = torch.empty(n, d, dtype=x.dtype, device=x.device)
    block_d = next_power_of_2(d)
    per = max(1, min(64, 4096 // block_d))
    if n:
        _layer_norm_kernel[(cdiv(n, per),)](
            rows,
            weight.contiguous(),
            bias.contiguous(),
            out,
            n,
            d,
            rows.stride(0),
            eps,
            ROWS=per,
            BLOCK_D=block_d,
            num_warps=4,
            **launch_options(rows),
        )
    return out.view(x.shape)


@triton.jit
def _paged_rows(table_ptr, stride_ts, stride_tp, s, j, ok, page_rows):
    """Flat rows of positions j [..] of stream s (0 where not ok)."""
    page = tl.load(table_ptr + s * stride_ts + (j // page_rows) * stride_tp, mask=ok, other=0)
    return page.to(tl.int64) * page_rows + j % page_rows


@triton.jit(do_not_specialize=["n_rows", "stride_ts", "stride_tp"])
def _pool_key_kernel(
    k_ptr,
    g_ptr,
    ape_ptr,
    out_ptr,
    pos_ptr,
    write_ptr,
    row_stream,
    n_rows,
    table_ptr,
    stride_ts,
    stride_tp,
    page_rows,
    stride_kn,
    stride_gn,
    stride_on,
    DI: tl.constexpr,
    DIP: tl.constexpr,
    KPOOL: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = r < n_rows
    t = tl.load(pos_ptr + r, mask=valid, other=0).to(tl.int32)  # [ROWS]
    ends = valid & (t % KPOOL == KPOOL - 1)  # rows that complete their pool
    # Most decode passes end no pool: the whole body (3·KPOOL masked loads) skipped then
    if tl.max(ends.to(tl.int32), axis=0) > 0:
        s = tl.load(row_stream + r, mask=ends, other=0)
        first = t - (KPOOL - 1)  # the pool's first position
        d = tl.arange(0, DIP)
        dok = d < DI
        lmask = ends[:, None] & dok[None, :]
        # K_p, as indexer.pool_keys: max, then the sum of exp, then the weighted keys in order
        top = tl.full((ROWS, DIP), float("-inf"), dtype=tl.float32)
        for i in tl.static_range(KPOOL):
            rows = _paged_rows(table_ptr, stride_ts, stride_tp, s, first + i, ends, page_rows)
            g = tl.load(g_ptr + rows[:, None] * stride_gn + d[None, :], mask=lmask, other=0.0)
            a = tl.load(ape_ptr + i * DI + d, mask=dok, other=0.0)
            top = tl.maximum(top, g.to(tl.float32) + a.to(tl.float32)[None, :])
        total = tl.zeros((ROWS, DIP), dtype=tl.float32)
        for i in tl.static_range(KPOOL):
            rows = _paged_rows(table_ptr, stride_ts, stride_tp, s, first + i, ends, page_rows)
            g = tl.load(g_ptr + rows[:, None] * stride_gn + d[None, :], mask=lmask, other=0.0)
            a = tl.load(ape_ptr + i * DI + d, mask=dok, other=0.0)
            total += tl.exp(g.to(tl.float32) + a.to(tl.float32)[None, :] - top)
        acc = tl.zeros((ROWS, DIP), dtype=tl.float32)
        for i in tl.static_range(KPOOL):
            rows = _paged_rows(table_ptr, stride_ts, stride_tp, s, first + i, ends, page_rows)
            g = tl.load(g_ptr + rows[:, None] * stride_gn + d[None, :], mask=lmask, other=0.0)
            k = tl.load(k_ptr + rows[:, None] * stride_kn + d[None, :], mask=lmask, other=0.0)
            a = tl.load(ape_ptr + i * DI + d, mask=dok, other=0.0)
            e = tl.exp(g.to(tl.float32) + a.to(tl.float32)[None, :] - top)
            weight = (e / total).to(k.dtype).to(tl.float32)
            acc += (weight * k.to(tl.float32)).to(k.dtype).to(tl.float32)
        dst = tl.load(write_ptr + r, mask=ends, other=0).to(tl.int64)  # the pool's last row
        tl.store(
            out_ptr + dst[:, None] * stride_on + d[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=lmask,
        )


def write_pool_keys(
    k_rows: torch.Tensor,
    g_rows: torch.Tensor,
    ape: torch.Tensor,
    key_rows: torch.Tensor,
    positions: torch.Tensor,
    write_index: torch.Tensor,
    meta: PassMeta,
    page_rows: int,
) -> None:
    """For each row of the pass at a position kpool·p + kpool - 1, K_p (indexer.pool_keys'
    arithmetic) into key_rows at that row's own flat row (write_index). k_rows, g_rows,
    key_rows [P*R, dI] flat paged buffers in one dtype; positions, write_index [N] int64;
    ape [kpool, dI]. The pool's other rows are read from the stream's pages: written by earlier
    passes or this one (k_rows and g_rows must hold the pass's rows already)."""
    assert key_rows.dtype == k_rows.dtype, "the cached key has the keys' dtype"
    n = positions.shape[0]
    if n == 0:
        return
    kpool, dim = ape.shape
    rows = min(16, next_power_of_2(max(n, 2)))  # a row's arithmetic is its own: any tile
    _pool_key_kernel[(cdiv(n, rows),)](
        k_rows,
        g_rows,
        ape.contiguous(),
        key_rows,
        positions,
        write_index,
        meta.row_stream,
        n,
        meta.table,
        meta.table.stride(0),
        meta.table.stride(1),
        page_rows,
        k_rows.stride(0),
        g_rows.stride(0),
        key_rows.stride(0),
        DI=dim,
        DIP=next_power_of_2(dim),
        KPOOL=kpool,
        ROWS=rows,
        num_warps=4,
        **launch_options(k_rows),
    )


@triton.jit(do_not_specialize=["stride_ts", "stride_tp", "W"])
def _score_kernel(
    q_ptr,
    w_ptr,
    pk_ptr,
    key_ptr,
    pos_ptr,
    block_stream,
    block_row0,
    block_len,
    table_ptr,
    stride_ts,
    stride_tp,
    page_rows,
    W,
    scale,
    w_scale,
    stride_qn,
    stride_qh,
    stride_wn,
    stride_pn,
    NI: tl.constexpr,
    DI: tl.constexpr,
    DIP: tl.constexpr,
    KPOOL: tl.constexpr,
    QB: tl.constexpr,
    PT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    after_prior(PDL)
    blk = tl.program_id(0)
    p0 = tl.program_id(1) * PT
    s = tl.load(block_stream + blk)
    row0 = tl.load(block_row0 + blk)
    n = tl.load(block_len + blk)
    r = tl.arange(0, QB)
    rvalid = r < n
    qrow = (row0 + r).to(tl.int64)
    t = tl.load(pos_ptr + qrow, mask=rvalid, other=-1).to(tl.int32)  # [QB]
    last = tl.load(pos_ptr + row0 + n - 1).to(tl.int32)
    p = p0 + tl.arange(0, PT)  # [PT]
    pool_end = p * KPOOL + KPOOL - 1
    loaded = pool_end <= last  # complete pools some query of the block may see: written rows
    candidate = (pool_end[None, :] <= t[:, None]) & rvalid[:, None]  # [QB, PT]
    keys = tl.full((QB, PT), -9223372036854775807 - 1, dtype=tl.int64)
    if p0 * KPOOL + KPOOL - 1 <= last:
        d = tl.arange(0, DIP)
        dok = d < DI
        # K_p, cached at the pool's last row by _pool_key_kernel
        rows = _paged_rows(table_ptr, stride_ts, stride_tp, s, pool_end, loaded, page_rows)
        pooled = tl.load(
            pk_ptr + rows[:, None] * stride_pn + d[None, :],
            mask=loaded[:, None] & dok[None, :],
            other=0.0,
        )  # [PT, DIP]
        score = tl.zeros((QB, PT), dtype=tl.float32)
        for h in range(NI):
            qh = tl.load(
                q_ptr + qrow[:, None] * stride_qn + h * stride_qh + d[None, :],
                mask=rvalid[:, None] & dok[None, :],
                other=0.0,
            )
            dots = mma(qh, tl.trans(pooled), tl.zeros((QB, PT), dtype=tl.float32), IEEE, INTERP)
            wh = tl.load(w_ptr + qrow * stride_wn + h, mask=rvalid, other=0.0).to(tl.float32)
            wh = wh * w_scale  # the head weights' scale, in fp32 as the CPU path applies it
            score += wh[:, None] * tl.maximum(dots * scale, 0.0)
        score = score + 0.0  # -0.0 -> +0.0: equal scores must have equal keys
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int32 order == float order
        unique = ordered.to(tl.int64) * 4294967296 + (4294967295 - p.to(tl.int64))[None, :]
        keys = tl.where(candidate, unique, keys)
    tl.store(
        key_ptr + qrow[:, None] * W + p[None, :], keys, mask=rvalid[:, None] & (p[None, :] < W)
    )


def pool_key_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_rows: torch.Tensor,
    kpool: int,
    positions: torch.Tensor,
    meta: PassMeta,
    page_rows: int,
    pools: int,
    scale: float,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """Each query's ranking key for pools [0, pools): [N, pools] int64, NO_POOL where the pool is
    not a candidate (incomplete, or ending after the query). q [N, nI, dI] (model dtype);
    weights [N, nI] (its rows may be strided), each head's weight read as fp32 times
    weight_scale (fp32: the CPU path's `weights.float() * weight_scale`, in the scores' launch);
    key_rows [P*R, dI] the flat paged pool keys (write_pool_keys), in q's dtype, of every
    complete pool ending at or before each block's last query."""
    n, heads, dim = q.shape
    keys = torch.empty(n, pools, dtype=torch.int64, device=q.device)
    if n == 0 or pools == 0:
        return keys
    q = q.contiguous()
    if weights.stride(1) != 1:
        weights = weights.contiguous()
    grid = (meta.num_blocks, cdiv(pools, POOL_TILE))
    _score_kernel[grid](
        q,
        weights,
        key_rows,
        keys,
        positions,
        meta.block_stream,
        meta.block_row0,
        meta.block_len,
        meta.table,
        meta.table.stride(0),
        meta.table.stride(1),
        page_rows,
        pools,
        scale,
        weight_scale,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        key_rows.stride(0),
        NI=heads,
        DI=dim,
        DIP=next_power_of_2(dim),
        KPOOL=kpool,
        QB=QUERY_ROWS,
        PT=POOL_TILE,
        IEEE=q.dtype == torch.float32,
        INTERP=interpreting(),
        num_warps=4,
        **launch_options(q),
    )
    return keys


@triton.jit
def _ascending_pools_kernel(best_ptr, out_ptr, K, W, KB: tl.constexpr, PDL: tl.constexpr = False):
    """A row's k best keys (any order) -> their pools ascending, -1 padded (int32)."""
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, KB)
    best = tl.load(best_ptr + row * K + j, mask=j < K, other=-9223372036854775807 - 1)
    pool = tl.where(
        best == -9223372036854775807 - 1, W, (4294967295 - (best & 4294967295)).to(tl.int32)
    )
    pool = tl.sort(pool)  # no-pools (== W, the padding too) last
    tl.store(out_ptr + row * K + j, tl.where(pool == W, -1, pool), mask=j < K)


@triton.jit
def _top_pools_kernel(
    key_ptr, out_ptr, K, W, WB: tl.constexpr, KB: tl.constexpr, PDL: tl.constexpr = False
):
    """A row's W keys -> the pools of its K best, ascending, -1 padded (int32). The candidates'
    keys are unique, so the K best are the candidates at or above the K-th largest key: a set,
    whatever sort finds it; its pools ascending are those columns in order."""
    after_prior(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, WB)
    none = -9223372036854775807 - 1
    key = tl.load(key_ptr + row * W + p, mask=p < W, other=none)
    ranked = tl.sort(key, descending=True)
    kth = tl.max(tl.where(p == K - 1, ranked, none), axis=0)
    chosen = (key >= kth) & (key != none)
    at = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
    count = tl.sum(chosen.to(tl.int32), axis=0)
    tl.store(out_ptr + row * K + at, p.to(tl.int32), mask=chosen)
    j = tl.arange(0, KB)
    tl.store(out_ptr + row * K + j, tl.full((KB,), -1, dtype=tl.int32), mask=(j >= count) & (j < K))


def top_pools(keys: torch.Tensor, limit: int) -> torch.Tensor:
    """The `limit` best candidates of each row, ascending, -1 padded: [N, min(limit, W)] int32.
    keys [N, W] int64 from pool_key_scores. Up to ONE_LAUNCH_MAX_POOLS pools a row, one launch a
    pass (_top_pools_kernel); wider, torch's top k, then one launch sorting the chosen pools
    (_ascending_pools_kernel; docs/performance.md, "ASCENDING_IN_ONE_LAUNCH")."""
    n, width = keys.shape
    k = min(limit, width)
    if k == 0:
        return torch.empty(n, 0, dtype=torch.int32, device=keys.device)
    if width <= ONE_LAUNCH_MAX_POOLS:
        out = torch.empty(n, k, dtype=torch.int32, device=keys.device)
        if n:
            keys = keys.contiguous()
            _top_pools_kernel[(n,)](
                keys,
                out,
                k,
                width,
                WB=next_power_of_2(width),
                KB=next_power_of_2(k),
                num_warps=4,
                **launch_options(keys),
            )
        return out
    best = torch.topk(keys, k, dim=1, sorted=False).values
    out = torch.empty(n, k, dtype=torch.int32, device=keys.device)
    if n:
        _ascending_pools_kernel[(n,)](
            best.contiguous(),
            out,
            k,
            width,
            KB=next_power_of_2(k),
            num_warps=4,
            **launch_options(best),
        )
    return out


def select_pools(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_rows: torch.Tensor,
    kpool: int,
    positions: torch.Tensor,
    meta: PassMeta,
    page_rows: int,
    pools: int,
    limit: int,
    scale: float,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """[N, min(limit, pools)] int32: each query's chosen pools (see the module docstring).
    key_rows: the flat paged pool keys (write_pool_keys run on this pass first); pools: an upper
    bound on the complete pools of any stream in the pass; weights, weight_scale as
    pool_key_scores takes them."""
    keys = pool_key_scores(
        q, weights, key_rows, kpool, positions, meta, page_rows, pools, scale, weight_scale
    )
    return top_pools(keys, limit)
