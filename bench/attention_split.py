"""Paged attention's decode rows at 1, 8 and 64 streams over 2k and 32k keys, on one GPU: the
key segments walked by one program (parts=1), shared (parts chosen by the pass), and, when
core/ops/_old_attention.py holds the kernel before segments, that one. µs a call, each from a
CUDA graph of 20 calls.

    python3 bench/attention_split.py
"""

from __future__ import annotations

import importlib

import torch

from tensorfold.forward_pass import ForwardPass, StreamRows
from tensorfold.ops import triton_attention
from tensorfold.ops.kv_quant import quantize_rows
from tensorfold.ops.pass_meta import build_meta

SHAPES = {"lfm2 (32/8 x 64)": (32, 8, 64), "gemma4 global (16/2 x 512)": (16, 2, 512)}
PAGE_ROWS = 512


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(5):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (5 * reps)


def main() -> None:
    try:
        old = importlib.import_module("tensorfold.ops._old_attention")
    except ImportError:
        old = None
    for name, (hq, hkv, d) in SHAPES.items():
        for context in (2048, 32768):
            for streams in (1, 8, 64):
                per = -(-(context + 1) // PAGE_ROWS)
                pages = streams * per
                if pages * PAGE_ROWS * hkv * d * 2 * 2 > 40e9:
                    continue
                runs = [StreamRows(s, context, [0], list(range(s * per, (s + 1) * per)), "all")
                        for s in range(streams)]
                fp = ForwardPass(runs, PAGE_ROWS, "cuda")
                meta = build_meta(fp)
                k = torch.randn(pages * PAGE_ROWS, hkv, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q = torch.randn(streams, hq, d, device="cuda", dtype=torch.bfloat16)
                for kv in ("bf16", "fp8"):
                    sc = {}
                    kk, vv = k, v
                    if kv == "fp8":
                        (kk, ks), (vv, vs) = quantize_rows(k), quantize_rows(v)
                        sc = {"k_scales": ks, "v_scales": vs}
                    row = []
                    for label, mod, parts in (("walk", triton_attention, 1),
                                              ("auto", triton_attention, None),
                                              ("old", old, "old")):
                        if mod is None:
                            continue
                        kw = {} if parts == "old" else {"parts": parts}
                        us = timed(lambda mod=mod, kw=kw: mod.paged_attention(
                            q, kk, vv, fp.positions, meta, PAGE_ROWS, scale=d**-0.5, **sc, **kw))
                        row.append(f"{label} {us:8.1f}")
                    print(f"{name:<27} ctx {context:>6} streams {streams:>2} {kv:<4} µs: "
                          + "  ".join(row), flush=True)
                del k, v, kk, vv


if __name__ == "__main__":
    main()
