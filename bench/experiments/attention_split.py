"""Attention's decode rows on one GPU, µs a call (each from a CUDA graph of 20 calls): the
paged kernel at 1 to 64 streams over 2k and 32k keys, and the ring kernel (gemma4's sliding
layers, a 1024-key window) at 1 to 64 streams; each with its key segments walked by one
program (parts=1) and shared (parts chosen by the pass), bf16 and fp8 rows. Another version of
the kernels to compare, laid beside them as core/ops/_old_attention.py and _old_window.py
(its triton_attention import pointed at _old_attention), is timed too ("old"), and the bits
of both are compared (equal: "=", else "≠").

    python3 bench/experiments/attention_split.py
    python3 bench/experiments/attention_split.py --warps=4,8   # the new kernels at each count of warps
    python3 bench/experiments/attention_split.py --parts=2,4   # and with these splits forced
    python3 bench/experiments/attention_split.py --tiles=small # every shape on 16-row tiles (fp8's), bf16 too
    python3 bench/experiments/attention_split.py --prefill     # and one prompt pass of 2k / 8k rows
    python3 bench/experiments/attention_split.py --wide=128:4,512:8  # wide heads (gemma4) at each
                                # (output columns, warps) a program; lfm2 once, at the default
    TRITON_INTERPRET=1 python3 bench/experiments/attention_split.py --smoke   # the CPU, tiny sizes, untimed
"""

from __future__ import annotations

import importlib
import sys

import torch

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops import triton_attention, triton_window
from tensorfold.ops.kv_quant import quantize_rows
from tensorfold.ops.pass_meta import build_meta
from tensorfold.ops.window_attention import RingScales

SHAPES = {"lfm2 (32/8 x 64)": (32, 8, 64), "gemma4 global (16/2 x 512)": (16, 2, 512)}
SMOKE = "--smoke" in sys.argv
# --parts=2,4: also time the kernels with these forced splits ("p2", "p4")
FORCED = [int(x) for a in sys.argv if a.startswith("--parts=") for x in a[8:].split(",")]
STREAMS = (1, 3) if SMOKE else (1, 8, 16, 32, 64)
PAGE_ROWS = 16 if SMOKE else 512
DEV = "cpu" if SMOKE else "cuda"
POS = 100 if SMOKE else 5000  # the ring's decode rows


def timed(fn, reps: int = 20) -> float:
    if SMOKE:
        fn()
        return 0.0
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


def optional(name: str):
    try:
        return importlib.import_module(f"tensorfold.ops.{name}")
    except ImportError:
        return None


SHIPPED_TILES = triton_attention.tiles


def small_tiles(d: int, dv: int, group: int, fp8: bool = False) -> tuple[int, int, int]:
    """--tiles=small: 16-row tiles (QB*GP = 16) for every head dim and dtype, as fp8 rows get."""
    return SHIPPED_TILES(d, dv, group, True)


def main() -> None:
    from tensorfold.ops import triton_key_split

    if "--tiles=small" in sys.argv:  # the new kernels only; the old keep theirs
        triton_attention.tiles = triton_window.tiles = small_tiles
        print("-- every shape on 16-row tiles (old: the shipped tiles)", flush=True)
    wide = [
        tuple(int(x) for x in c.split(":"))
        for a in sys.argv
        if a.startswith("--wide=")
        for c in a[7:].split(",")
    ]
    if wide:
        for i, (bdv, w) in enumerate(wide):
            triton_attention.WIDE_BDV, triton_attention.WIDE_WARPS = bdv, w
            print(f"-- wide heads: {bdv} output columns, {w} warps a program", flush=True)
            paged(wide_only=i > 0)
            ring()
            if "--prefill" in sys.argv:
                prefill(wide_only=True)
        return
    if "--prefill" in sys.argv:
        prefill()
    warps = [int(w) for a in sys.argv if a.startswith("--warps=") for w in a[8:].split(",")]
    for w in warps or [triton_key_split.WARPS]:
        triton_key_split.WARPS = w
        print(f"-- {w} warps an attention program (the old kernels keep theirs)", flush=True)
        paged()
        ring()


def ring() -> None:
    """gemma4's sliding layers: 16 query heads, 8 KV heads of 256, a 1024-key window, each
    stream's decode row at position 5000 with its ring full."""
    old = optional("_old_window")
    hq, hkv, d, window = (4, 2, 16, 40) if SMOKE else (16, 8, 256, 1024)
    for streams in STREAMS:
        runs = [
            StreamRows(s, POS, [0], [0] * (POS // PAGE_ROWS + 1), "all") for s in range(streams)
        ]
        fp = ForwardPass(runs, PAGE_ROWS, DEV)
        meta = build_meta(fp)
        q = torch.randn(streams, hq, d, device=DEV, dtype=torch.bfloat16)
        nk, nv = (torch.randn(streams, hkv, d, device=DEV, dtype=torch.bfloat16) for _ in range(2))
        rk, rv = (
            torch.randn(streams, window - 1, hkv, d, device=DEV, dtype=torch.bfloat16)
            for _ in range(2)
        )
        for kv in ("bf16", "fp8"):
            args, sc = (nk, nv, rk, rv), None
            if kv == "fp8":
                (a, sa), (b, sb), (c, scc), (e, se) = (quantize_rows(x) for x in args)
                args, sc = (a, b, c, e), RingScales(sa, sb, scc, se)
            outs, row = [], []
            for label, mod, parts in (
                ("walk", triton_window, 1),
                ("auto", triton_window, None),
                *((f"p{f}", triton_window, f) for f in FORCED),
                ("old", old, "old"),
            ):
                if mod is None:
                    continue
                kw = {} if parts == "old" else {"parts": parts}

                def call(mod=mod, kw=kw):
                    return mod.ring_attention(
                        q, *args, fp.positions, meta, scale=d**-0.5, window=window, scales=sc, **kw
                    )

                outs.append(call())
                row.append(f"{label} {timed(call):8.1f}")
            same = "=" if all(torch.equal(o, outs[0]) for o in outs) else "≠"
            print(
                f"{f'ring ({hq}/{hkv} x {d})':<27} win {window:>6} streams {streams:>2} {kv:<4} "
                f"µs: " + "  ".join(row) + f"  bits {same}",
                flush=True,
            )


def shapes_for(wide_only: bool) -> dict[str, tuple[int, int, int]]:
    if SMOKE:
        return {"smoke (4/2 x 16)": (4, 2, 16)}
    return {n: s for n, s in SHAPES.items() if not wide_only or s[2] > triton_attention.WIDE_HEAD}


def prefill(wide_only: bool = False) -> None:
    """One stream's prompt of 2k and 8k rows in one pass (prompt rows see each other)."""
    old = optional("_old_attention")
    shapes = shapes_for(wide_only)
    for name, (hq, hkv, d) in shapes.items():
        for rows in (40,) if SMOKE else (2048, 8192):
            per = -(-rows // PAGE_ROWS)
            fp = ForwardPass(
                [StreamRows(0, 0, [0] * rows, list(range(per)), "last")], PAGE_ROWS, DEV
            )
            meta = build_meta(fp)
            k = torch.randn(per * PAGE_ROWS, hkv, d, device=DEV, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(rows, hq, d, device=DEV, dtype=torch.bfloat16)
            for kv in ("bf16", "fp8"):
                kk, vv, sc = k, v, {}
                if kv == "fp8":
                    (kk, ks), (vv, vs) = quantize_rows(k), quantize_rows(v)
                    sc = {"k_scales": ks, "v_scales": vs}
                outs, row = [], []
                for label, mod in (("new", triton_attention), ("old", old)):
                    if mod is None:
                        continue

                    def call(mod=mod, kk=kk, vv=vv, sc=sc):
                        return mod.paged_attention(
                            q, kk, vv, fp.positions, meta, PAGE_ROWS, scale=d**-0.5, **sc
                        )

                    outs.append(call())
                    row.append(f"{label} {timed(call, 3):8.1f}")
                same = "=" if all(torch.equal(o, outs[0]) for o in outs) else "≠"
                print(
                    f"{name:<27} prompt {rows:>5} rows, one pass, {kv:<4} µs: "
                    + "  ".join(row)
                    + f"  bits {same}",
                    flush=True,
                )


def paged(wide_only: bool = False) -> None:
    old = optional("_old_attention")
    shapes = shapes_for(wide_only)
    for name, (hq, hkv, d) in shapes.items():
        for context in (300,) if SMOKE else (2048, 32768):
            for streams in STREAMS:
                per = -(-(context + 1) // PAGE_ROWS)
                pages = streams * per
                if pages * PAGE_ROWS * hkv * d * 2 * 2 > 40e9:
                    continue
                runs = [
                    StreamRows(s, context, [0], list(range(s * per, (s + 1) * per)), "all")
                    for s in range(streams)
                ]
                fp = ForwardPass(runs, PAGE_ROWS, DEV)
                meta = build_meta(fp)
                k = torch.randn(pages * PAGE_ROWS, hkv, d, device=DEV, dtype=torch.bfloat16)
                v = torch.randn_like(k)
                q = torch.randn(streams, hq, d, device=DEV, dtype=torch.bfloat16)
                for kv in ("bf16", "fp8"):
                    sc = {}
                    kk, vv = k, v
                    if kv == "fp8":
                        (kk, ks), (vv, vs) = quantize_rows(k), quantize_rows(v)
                        sc = {"k_scales": ks, "v_scales": vs}
                    outs, row = [], []
                    for label, mod, parts in (
                        ("walk", triton_attention, 1),
                        ("auto", triton_attention, None),
                        *((f"p{f}", triton_attention, f) for f in FORCED),
                        ("old", old, "old"),
                    ):
                        if mod is None:
                            continue
                        kw = {} if parts == "old" else {"parts": parts}

                        def call(mod=mod, kw=kw, kk=kk, vv=vv, sc=sc):
                            return mod.paged_attention(
                                q, kk, vv, fp.positions, meta, PAGE_ROWS, scale=d**-0.5, **sc, **kw
                            )

                        outs.append(call())
                        row.append(f"{label} {timed(call):8.1f}")
                    same = "=" if all(torch.equal(o, outs[0]) for o in outs) else "≠"
                    print(
                        f"{name:<27} ctx {context:>6} streams {streams:>2} {kv:<4} µs: "
                        + "  ".join(row)
                        + f"  bits {same}",
                        flush=True,
                    )
                del k, v, kk, vv


if __name__ == "__main__":
    main()
