"""Each Triton kernel on the GPU at LFM2-8B-A1B's sizes: error against its torch reference
(run on the same GPU with the kernels off), batch invariance (a row alone == the row among
2048), and its time against cuBLAS / the bytes it must read."""

from __future__ import annotations

from typing import Any, Callable

import torch
import triton.testing

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops import attention, gpu, linear, moe, norms, triton_linear, triton_moe

BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def timed(fn: Callable[[], Any]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def reference(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    gpu.set_triton(False)
    try:
        return fn()
    finally:
        gpu.set_triton(True)


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(BF16)


LINEAR_SHAPES = {  # (N, K): where
    "conv.in_proj": (6144, 2048),
    "conv.out_proj/q/o": (2048, 2048),
    "k/v": (512, 2048),
    "dense w1/w3": (7168, 2048),
    "dense w2": (2048, 7168),
    "lm_head": (65536, 2048),
    "router": (32, 2048),
}


def check_linear() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (n, k) in LINEAR_SHAPES.items():
        w = _randn(n, k, scale=0.02)
        x = _randn(2048, k)
        got = linear.linear(x, w)
        row = {
            "rel_err": rel(got, reference(lambda: linear.linear(x, w))),
            "row_alone_equal": bool(torch.equal(linear.linear(x[7:8].clone(), w), got[7:8])),
        }
        for m in (1, 64, 2048):
            xm = x[:m].contiguous()
            t = timed(lambda: linear.linear(xm, w))
            t_ref = timed(lambda: torch.matmul(xm, w.t()))
            row[f"m{m}_ms"] = t
            row[f"m{m}_cublas_ms"] = t_ref
            row[f"m{m}_weight_tb_per_s"] = n * k * 2 / t / 1e9
            row[f"m{m}_tflops"] = 2 * m * n * k / t / 1e9
        out[name] = row
    return out


def sweep_linear() -> dict[str, Any]:
    """Tile shapes per weight shape, at 1, 64 and 2048 rows (the table is keyed by (N, K) only)."""
    T = triton_linear.Tiles
    configs = [
        (64, T(64, 64, 4, 4)),
        (64, T(128, 64, 4, 4)),
        (64, T(32, 128, 4, 4)),
        (64, T(64, 128, 4, 3)),
        (128, T(128, 64, 8, 3)),
        (128, T(256, 64, 8, 3)),
        (128, T(64, 64, 4, 4)),
    ]
    out: dict[str, Any] = {}
    saved = dict(triton_linear.TUNED)
    small_rows, triton_linear.SMALL_ROWS = (
        triton_linear.SMALL_ROWS,
        1 << 62,
    )  # one config at every m
    for name, (n, k) in LINEAR_SHAPES.items():
        w = _randn(n, k, scale=0.02)
        x = _randn(2048, k)
        base = linear.linear(x, w)
        rows = {}
        for bm, c in configs:
            triton_linear.TUNED[(n, k)] = c
            triton_linear.BLOCK_M = bm
            try:
                got = linear.linear(x, w)
                r = {"same_bits_as_default": bool(torch.equal(got, base))}
                for m in (1, 64, 2048):
                    xm = x[:m].contiguous()
                    r[f"m{m}_ms"] = timed(lambda: linear.linear(xm, w))
            except Exception as exc:  # a config that does not fit (shared memory)
                r = {"error": f"{type(exc).__name__}: {exc}"[:200]}
            rows[f"bm{bm} {c.block_n}x{c.block_k}w{c.warps}s{c.stages}"] = r
        triton_linear.BLOCK_M = 64
        if (n, k) in saved:
            triton_linear.TUNED[(n, k)] = saved[(n, k)]
        else:
            triton_linear.TUNED.pop((n, k), None)
        out[name] = rows
    triton_linear.SMALL_ROWS = small_rows
    return out


def check_moe(e: int = 32, i: int = 1792, h: int = 2048, k: int = 4) -> dict[str, Any]:
    gate_up = _randn(e, 2 * i, h, scale=0.02)
    down = _randn(e, h, i, scale=0.02)
    w1, w3, w2 = (
        list(gate_up[:, :i].unbind(0)),
        list(gate_up[:, i:].unbind(0)),
        list(down.unbind(0)),
    )
    gate = _randn(e, h, scale=0.02)
    bias = torch.randn(e, device="cuda") * 0.01
    x = _randn(2048, h)

    def layer(xx):
        wts, ex = moe.route(xx, gate, bias, k, norm_topk_prob=True)
        return moe.moe(xx, wts, ex, w1, w3, w2)

    got = layer(x)
    ref_w, ref_e = reference(lambda: moe.route(x, gate, bias, k, norm_topk_prob=True))
    got_w, got_e = moe.route(x, gate, bias, k, norm_topk_prob=True)
    out: dict[str, Any] = {
        "route_experts_equal_frac": float((got_e == ref_e).all(-1).float().mean()),
        "route_weights_rel_err": rel(got_w, ref_w),
        "rel_err": rel(got, reference(lambda: moe.moe(x, got_w, got_e, w1, w3, w2))),
        "row_alone_equal": bool(torch.equal(layer(x[5:6].clone()), got[5:6])),
        "rows_0_64_equal": bool(torch.equal(layer(x[:64].clone()), got[:64])),
    }
    expert_bytes = 3 * i * h * 2
    for m in (1, 8, 64, 2048):
        xm = x[:m].contiguous()
        t = timed(lambda: layer(xm))
        _, ex = moe.route(xm, gate, bias, k, norm_topk_prob=True)
        hit = int(torch.unique(ex).numel())
        out[f"m{m}_ms"] = t
        out[f"m{m}_experts_hit"] = hit
        out[f"m{m}_weight_tb_per_s"] = hit * expert_bytes / t / 1e9
        out[f"m{m}_tflops"] = 2 * m * k * 3 * i * h / t / 1e9
    return out


def sweep_moe(e: int = 32, i: int = 1792, h: int = 2048, k: int = 4) -> dict[str, Any]:
    """Tile shapes of the two grouped GEMMs (and BLOCK_M), timed on a whole MoE layer."""
    T = triton_moe.Tiles
    variants = {
        "bm64 sw64x64w4s4 dn64x64w4s4": (64, T(64, 64, 4, 4), T(64, 64, 4, 4)),
        "bm64 sw64x128w4s3 dn64x128w4s3": (64, T(64, 128, 4, 3), T(64, 128, 4, 3)),
        "bm64 sw128x64w4s3 dn128x64w4s3": (64, T(128, 64, 4, 3), T(128, 64, 4, 3)),
        "bm64 sw64x64w4s4 dn32x128w4s4": (64, T(64, 64, 4, 4), T(32, 128, 4, 4)),
        "bm64 sw128x64w8s3 dn64x128w4s4": (64, T(128, 64, 8, 3), T(64, 128, 4, 4)),
        "bm128 sw128x64w8s3 dn128x64w8s3": (128, T(128, 64, 8, 3), T(128, 64, 8, 3)),
        "bm128 sw64x64w4s3 dn64x64w4s3": (128, T(64, 64, 4, 3), T(64, 64, 4, 3)),
        "bm128 sw128x64w8s3 dn64x128w8s3": (128, T(128, 64, 8, 3), T(64, 128, 8, 3)),
        "bm128 sw256x64w8s3 dn128x64w8s3": (128, T(256, 64, 8, 3), T(128, 64, 8, 3)),
    }
    gate_up = _randn(e, 2 * i, h, scale=0.02)
    down = _randn(e, h, i, scale=0.02)
    w1, w3, w2 = (
        list(gate_up[:, :i].unbind(0)),
        list(gate_up[:, i:].unbind(0)),
        list(down.unbind(0)),
    )
    gate = _randn(e, h, scale=0.02)
    bias = torch.randn(e, device="cuda") * 0.01
    x = _randn(2048, h)
    dw1, dw3, dw2 = (
        _randn(7168, h, scale=0.02),
        _randn(7168, h, scale=0.02),
        _randn(h, 7168, scale=0.02),
    )
    saved = (
        triton_moe.BLOCK_M,
        triton_moe.SWIGLU_TILES,
        triton_moe.DOWN_TILES,
        triton_moe.SMALL_ROWS,
    )
    triton_moe.SMALL_ROWS = -1  # one config at every row count

    def layer(xx):
        wts, ex = moe.route(xx, gate, bias, k, norm_topk_prob=True)
        return moe.moe(xx, wts, ex, w1, w3, w2)

    out: dict[str, Any] = {}
    base = None
    for name, (bm, sw, dn) in variants.items():
        triton_moe.BLOCK_M, triton_moe.SWIGLU_TILES, triton_moe.DOWN_TILES = bm, sw, dn
        triton_moe._IDENTITY.clear()
        try:
            got = layer(x)
            base = got if base is None else base
            r: dict[str, Any] = {"same_bits_as_first": bool(torch.equal(got, base))}
            for m in (1, 64, 2048):
                xm = x[:m].contiguous()
                r[f"m{m}_ms"] = timed(lambda: layer(xm))
                r[f"dense_m{m}_ms"] = timed(lambda: moe.gated_ffn(xm, dw1, dw3, dw2))
        except Exception as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out[name] = r
    triton_moe.BLOCK_M, triton_moe.SWIGLU_TILES, triton_moe.DOWN_TILES, triton_moe.SMALL_ROWS = (
        saved
    )
    triton_moe._IDENTITY.clear()
    return out


def check_attention(ctx: int = 8192, hq: int = 32, hkv: int = 8, d: int = 64) -> dict[str, Any]:
    page_rows = 512
    pages = ctx // page_rows + 1
    streams = 64
    total_pages = streams * pages
    kbuf = _randn(total_pages * page_rows, hkv, d)
    vbuf = _randn(total_pages * page_rows, hkv, d)
    perm = torch.randperm(total_pages).tolist()
    tables = [perm[s * pages : (s + 1) * pages] for s in range(streams)]
    out: dict[str, Any] = {}
    # prefill: 2048 rows at positions [ctx - 2048, ctx) of one stream
    fp = ForwardPass([StreamRows(0, ctx - 2048, [0] * 2048, tables[0])], page_rows, "cuda")
    q = _randn(2048, hq, d)
    got = attention.paged_attention(q, kbuf, vbuf, fp, scale=d**-0.5)
    want = reference(lambda: attention.paged_attention(q, kbuf, vbuf, fp, scale=d**-0.5))
    out["prefill_rel_err"] = rel(got, want)
    out["prefill_ms"] = timed(lambda: attention.paged_attention(q, kbuf, vbuf, fp, scale=d**-0.5))
    flops = 4 * hq * d * sum(range(ctx - 2048 + 1, ctx + 1))
    out["prefill_tflops"] = flops / out["prefill_ms"] / 1e9
    # decode: 64 streams, one row each at position ctx - 1, beside the same rows alone
    dec = ForwardPass(
        [StreamRows(s, ctx - 1, [0], tables[s]) for s in range(streams)], page_rows, "cuda"
    )
    qd = _randn(streams, hq, d)
    got_d = attention.paged_attention(qd, kbuf, vbuf, dec, scale=d**-0.5)
    one = ForwardPass([StreamRows(3, ctx - 1, [0], tables[3])], page_rows, "cuda")
    out["decode_row_alone_equal"] = bool(
        torch.equal(
            attention.paged_attention(qd[3:4].clone(), kbuf, vbuf, one, scale=d**-0.5), got_d[3:4]
        )
    )
    out["decode_ms"] = timed(lambda: attention.paged_attention(qd, kbuf, vbuf, dec, scale=d**-0.5))
    out["decode_kv_tb_per_s"] = streams * ctx * hkv * d * 2 * 2 / out["decode_ms"] / 1e9
    return out


def check_norm() -> dict[str, Any]:
    x, r = _randn(2048, 2048), _randn(2048, 2048)
    w = _randn(2048) + 1
    got, h = norms.add_rms_norm(x, r, w, 1e-5)
    return {
        "rel_err": rel(got, reference(lambda: norms.rms_norm(x + r, w, 1e-5))),
        "residual_equal": bool(torch.equal(h, x + r)),
        "m2048_ms": timed(lambda: norms.rms_norm(x, w, 1e-5)),
        "m1_ms": timed(lambda: norms.rms_norm(x[:1], w, 1e-5)),
    }


def run_all(sweep: bool = True) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, fn in (
        ("linear", check_linear),
        ("moe", check_moe),
        ("attention", check_attention),
        ("rms_norm", check_norm),
    ):
        try:
            res[name] = fn()
        except Exception:
            import traceback

            res[name] = {"error": traceback.format_exc()[-2000:]}
    if sweep:
        for name, fn in (("moe_sweep", sweep_moe), ("linear_sweep", sweep_linear)):
            try:
                res[name] = fn()
            except Exception:
                import traceback

                res[name] = {"error": traceback.format_exc()[-2000:]}
    return res
