"""fp8 weights' kernels against the bf16 ones, at each family's shapes (issue 58).

For LFM2-8B-A1B, Gemma-4-26B-A4B and GLM-5.3-Flash-8L: the linears of a layer (attention or
conv, KDA, MLA), the dense FFN and the experts, each at 1, 8 and 64 rows (one stream's decode
and a few streams') and 2048 (a prompt pass), in bf16 (triton_linear, triton_moe) and in fp8
with 128 x 128 block scales (triton_fp8: what the FP8 releases ship and `--quantization fp8`
makes). Each variant is `--reps` back-to-back calls captured in one CUDA graph, cycling through
weight copies (or expert routes) that together hold more bytes than the L2, the replay timed with
events, the median of 15. Reported per call: µs, the speedup of fp8 over bf16, the weight bytes
read per second (codes and scales; experts: those the call's rows chose) and their share of the
GPU's peak, TFLOP/s at 2048 rows. Each fp8 variant is also checked: the bits of the bf16 kernel
over the dequantized weight, and a row alone as in the pass.

    python bench/fp8_kernels.py --out $OUT              # the table, and results.json in $OUT
    python bench/fp8_kernels.py --smoke                 # tiny shapes on the CPU (interpreter)
    python bench/fp8_kernels.py --tiles --out $OUT      # one row's fp8 tiles of their own (tiles.json)

One call of about 3 minutes on an H100 (most of it compiling). TF_DEPENDENT_LAUNCH applies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.experiments.decode_kernels import graph_us as graph_us_on  # noqa: E402
from tensorfold.ops import triton_fp8, triton_linear, triton_moe  # noqa: E402
from tensorfold.ops.fp8 import Fp8Weight, quantize_blocks  # noqa: E402

BF16 = torch.bfloat16
BLOCK = (128, 128)
L2_BYTES = 60 << 20
PEAK_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # SXM HBM3 / HBM3e
ROWS = (1, 8, 64, 2048)

# family -> {name: ("linear", N, K) | ("dense", I, H) | ("moe", E, I, H, top k)}
SHAPES: dict[str, dict[str, tuple]] = {
    "LFM2-8B-A1B": {
        "conv in_proj": ("linear", 6144, 2048),
        "q+k+v": ("linear", 3072, 2048),
        "o / conv out_proj": ("linear", 2048, 2048),
        "dense FFN": ("dense", 7168, 2048),
        "experts": ("moe", 32, 1792, 2048, 4),
    },
    "Gemma-4-26B-A4B": {
        "q+k+v (sliding)": ("linear", 8192, 2816),
        "q+k (full)": ("linear", 9216, 2816),
        "o (sliding)": ("linear", 2816, 4096),
        "dense FFN": ("dense", 2112, 2816),
        "experts": ("moe", 128, 704, 2816, 8),
    },
    "GLM-5.3-Flash-8L": {
        "KDA q+k+v": ("linear", 24576, 4096),
        "KDA o": ("linear", 4096, 8192),
        "MLA q_a": ("linear", 1536, 4096),
        "MLA q_b": ("linear", 16384, 1536),
        "MLA o": ("linear", 4096, 16384),
        "dense FFN": ("dense", 12288, 4096),
        "shared expert": ("dense", 2048, 4096),
        "experts": ("moe", 288, 2048, 4096, 8),
    },
}
SMOKE: dict[str, dict[str, tuple]] = {
    "smoke": {
        "linear": ("linear", 136, 256),
        "dense FFN": ("dense", 136, 256),
        "experts": ("moe", 4, 136, 256, 2),
    }
}

DEVICE = "cuda"


def copies_for(nbytes: int) -> int:
    """Weight copies to cycle through: together three L2s or more (2 .. 16; 2 on the CPU)."""
    if DEVICE == "cpu":
        return 2
    return max(2, min(16, 3 * L2_BYTES // max(nbytes, 1) + 1))


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    """bf16 normal draws; a stack 16 matrices at a time (bounded fp32 scratch)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    out = torch.empty(*shape, dtype=BF16, device=DEVICE)
    step = 16 if len(shape) == 3 else shape[0]
    for a in range(0, shape[0], step):
        part = out[a : a + step]
        part.copy_(torch.randn(part.shape, generator=g, device=DEVICE) * scale)
    return out


def quantized(w: torch.Tensor) -> triton_fp8.Fp8Parts:
    """w [..., N, K] in 128 x 128 blocks, a few experts at a time (bounded fp32 scratch)."""
    return triton_fp8.parts(quantize_blocks(w, BLOCK))  # a stack a matrix at a time


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Case:
    """One shape: its bf16 and fp8 weight copies, its calls at m rows in each, the weight bytes a
    call reads, its flops."""

    def __init__(self, spec: tuple, seed: int):
        self.kind = spec[0]
        self.spec = spec
        self._dequantized: Any = None
        if self.kind == "linear":
            n, k = spec[1:]
            self.hidden, self.width = k, n
            per_copy = n * k * 2
            self.bf16 = [
                randn(n, k, seed=seed + c, scale=0.02) for c in range(copies_for(per_copy))
            ]
            self.fp8 = [quantized(w) for w in self.bf16]
            self.flops_per_row = 2 * n * k
        elif self.kind == "dense":
            i, h = spec[1:]
            self.hidden, self.width = h, i
            per_copy = 3 * i * h * 2
            self.bf16 = [
                (
                    randn(i, h, seed=seed + 3 * c, scale=0.02),
                    randn(i, h, seed=seed + 3 * c + 1, scale=0.02),
                    randn(h, i, seed=seed + 3 * c + 2, scale=0.02),
                )
                for c in range(copies_for(per_copy))
            ]
            self.fp8 = [tuple(quantized(w) for w in ws) for ws in self.bf16]
            self.flops_per_row = 2 * 3 * i * h
        else:
            e, i, h, topk = spec[1:]
            self.hidden, self.width, self.experts, self.topk = h, i, e, topk
            gate_up = randn(e, 2 * i, h, seed=seed, scale=0.02)
            down = randn(e, h, i, seed=seed + 1, scale=0.02)
            # one set of weights (GLM's 288 experts: 14 GB in bf16); the calls cycle through routes
            self.bf16 = [(gate_up[:, :i], gate_up[:, i:], down)]
            # quantized fused, as Gemma 4's experts ship (I = 704: the up half starts inside a
            # row block), and cut into views as the families' paths cut it
            gate, up = triton_fp8.gate_and_up(quantize_blocks(gate_up, BLOCK), i)
            self.fp8 = [(triton_fp8.parts(gate), triton_fp8.parts(up), quantized(down))]
            self.flops_per_row = 2 * 3 * i * h * topk

    def routes(self, m: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`count` routes of m rows: one row's calls take disjoint experts in turn (its k
        after the last call's), more rows random ones; weights normalised."""
        out = []
        g = torch.Generator(device=DEVICE).manual_seed(m)
        for r in range(count):
            if m == 1:
                ex = (r * self.topk + torch.arange(self.topk, device=DEVICE)) % self.experts
                ex = ex[None]
            else:
                ex = torch.rand(m, self.experts, generator=g, device=DEVICE).topk(self.topk).indices
            wt = torch.rand(m, self.topk, generator=g, device=DEVICE) + 0.1
            out.append(((wt / wt.sum(-1, keepdim=True)).to(BF16), ex))
        return out

    def call(self, fp8: bool, x: torch.Tensor, w: Any, route: Any = None) -> torch.Tensor:
        if self.kind == "linear":
            return triton_fp8.linear_fp8(x, *w) if fp8 else triton_linear.linear(x, w)
        if self.kind == "dense":
            return triton_fp8.gated_ffn_fp8(x, *w) if fp8 else triton_moe.gated_ffn(x, *w)
        wt, ex = route
        return triton_fp8.moe_fp8(x, wt, ex, *w) if fp8 else triton_moe.moe(x, wt, ex, *w)

    def weight_bytes(self, fp8: bool, route: Any = None) -> int:
        """Weight bytes a call reads: the codes and scales (fp8) or the bf16 weight; experts:
        those its rows chose."""
        if self.kind == "linear":
            return nbytes(*self.fp8[0][:2]) if fp8 else nbytes(self.bf16[0])
        if self.kind == "dense":
            if fp8:
                return sum(nbytes(*w[:2]) for w in self.fp8[0])
            return nbytes(*self.bf16[0])
        e, i, h = self.experts, self.width, self.hidden
        per_expert = 3 * i * h * 2
        if fp8:
            per_expert = sum(nbytes(*w[:2]) for w in self.fp8[0]) // e
        return int(route[1].unique().numel()) * per_expert

    def dequantized(self) -> Any:
        """The first fp8 copy dequantized to bf16 (experts a few at a time), made once."""
        if self._dequantized is None:
            if self.kind == "linear":
                self._dequantized = Fp8Weight(*self.fp8[0]).dequantize(BF16)
            else:
                self._dequantized = tuple(_dequantize(w) for w in self.fp8[0])
        return self._dequantized


def _dequantize(w: triton_fp8.Fp8Parts) -> torch.Tensor:
    q, s, block, row0 = w
    if q.dim() == 2:
        return Fp8Weight(q, s, block, row0).dequantize(BF16)
    parts = [
        Fp8Weight(q[e : e + 16], s[e : e + 16], block, row0).dequantize(BF16)
        for e in range(0, q.shape[0], 16)
    ]
    return torch.cat(parts)


def measure(case: Case, m: int, reps: int, peak: float) -> dict[str, Any]:
    x = randn(max(m, 2048), case.hidden, seed=99)
    xm = x[:m].contiguous()
    count = (8 if DEVICE == "cuda" else 2) if case.kind == "moe" else len(case.bf16)
    routes = case.routes(m, count) if case.kind == "moe" else [None] * count
    row: dict[str, Any] = {"rows": m}
    for label, fp8 in (("bf16", False), ("fp8", True)):
        weights = case.fp8 if fp8 else case.bf16
        calls = [
            lambda r=r, w=weights[c % len(weights)]: case.call(fp8, xm, w, r)
            for c, r in enumerate(routes)
        ]
        us = graph_us_on(calls, reps if m < 2048 else max(4, reps // 8), DEVICE)
        read = statistics.mean(case.weight_bytes(fp8, r) for r in routes)
        row[label] = {
            "us": us,
            "weight_mb": read / 1e6,
            "gb_per_s": read / us / 1e3,
            "of_peak": read / us / 1e-6 / peak,
            "tflop_per_s": case.flops_per_row * m / us / 1e6,
        }
    row["speedup"] = row["bf16"]["us"] / row["fp8"]["us"]
    # the bits: the bf16 kernel over the dequantized weight, and a row alone as in the pass
    got = case.call(True, xm, case.fp8[0], routes[0])
    want = case.call(False, xm, case.dequantized(), routes[0])
    alone = case.call(
        True,
        xm[-1:].clone(),
        case.fp8[0],
        None if routes[0] is None else tuple(t[-1:].clone() for t in routes[0]),
    )
    row["bf16_kernel_bits"] = bool(torch.equal(got, want))
    row["row_alone_bits"] = bool(torch.equal(alone, got[-1:]))
    return row


# --tiles: an fp8 weight's own tiles for a few rows (triton_linear.FP8_TUNED,
# triton_moe.FP8_FEW_ROWS_TILES), each against the bf16 tiles at one row
# more warps than the bf16 tiles too: a warp's share of the in-register conversion
LINEAR_CANDIDATES = [
    triton_linear.Tiles(bn, 128, w, st) for bn in (32, 64) for w in (4, 8) for st in (4, 6, 8)
] + [triton_linear.Tiles(16, 128, 4, 6), triton_linear.Tiles(32, 64, 4, 8)]
MOE_CANDIDATES = [
    triton_moe.Tiles(bn, bk, w, st)
    for bn, bk, w, st in (
        (32, 128, 4, 4),
        (32, 128, 4, 6),
        (32, 128, 8, 6),
        (64, 128, 4, 4),
        (64, 128, 8, 4),
        (16, 128, 2, 6),
        (32, 64, 4, 5),
        (64, 64, 8, 5),
    )
]


def sweep(case: Case, reps: int) -> dict[str, Any]:
    """The fp8 case at one row on the bf16 tiles ("bf16 tiles") and on each candidate: µs a
    call, and whether the row has the bits of the same row in a 700-row pass (bf16 tiles). A
    dense FFN of a few rows takes the experts' few-row tiles (FP8_FEW_ROWS_TILES): choose them
    for both."""
    x = randn(700, case.hidden, seed=98)
    routes = case.routes(1, 8) if case.kind == "moe" else [None] * len(case.fp8)
    big_route = case.routes(700, 1)[0] if case.kind == "moe" else None
    if big_route is not None:
        big_route = tuple(torch.cat([r[:1], b[1:]]) for r, b in zip(routes[0], big_route))
    full = case.call(True, x, case.fp8[0], big_route)
    x1 = x[:1].contiguous()
    out: dict[str, Any] = {}
    saved = (dict(triton_linear.FP8_TUNED), triton_moe.FP8_FEW_ROWS_TILES)
    if case.kind == "linear":
        n, k = case.spec[1:]
        cands = {
            f"bn{t.block_n} bk{t.block_k} w{t.warps} s{t.stages}": t for t in LINEAR_CANDIDATES
        }
    else:
        cands = {f"bn{t.block_n} bk{t.block_k} w{t.warps} s{t.stages}": t for t in MOE_CANDIDATES}
    for label, t in [("bf16 tiles", None), *cands.items()]:
        triton_linear.FP8_TUNED.clear()
        triton_linear.FP8_TUNED.update(saved[0])
        triton_moe.FP8_FEW_ROWS_TILES = saved[1]
        if t is not None and case.kind == "linear":
            triton_linear.FP8_TUNED[(n, k)] = t
        elif t is not None:
            triton_moe.FP8_FEW_ROWS_TILES = (t, t)
        try:
            one = case.call(
                True,
                x1,
                case.fp8[0],
                None if big_route is None else tuple(a[:1] for a in big_route),
            )
            calls = [
                lambda r=r, w=case.fp8[c % len(case.fp8)]: case.call(True, x1, w, r)
                for c, r in enumerate(routes)
            ]
            out[label] = {
                "us": graph_us_on(calls, reps, DEVICE),
                "bits": bool(torch.equal(one, full[:1])),
            }
        except Exception as exc:  # a tile Triton cannot build, or one the chunks refuse
            out[label] = {"error": str(exc)[:160]}
    triton_linear.FP8_TUNED.clear()
    triton_linear.FP8_TUNED.update(saved[0])
    triton_moe.FP8_FEW_ROWS_TILES = saved[1]
    return out


def sweep_table(results: dict[str, Any]) -> str:
    lines = [f"{'family':18} {'op':20} {'bf16 tiles µs':>13} {'best':>24} {'µs':>8} bits"]
    for family, ops in results["tiles"].items():
        for op, res in ops.items():
            base = res["bf16 tiles"].get("us", float("nan"))
            ok = {k: v for k, v in res.items() if "us" in v and v["bits"] and k != "bf16 tiles"}
            best = min(ok, key=lambda k: ok[k]["us"]) if ok else "-"
            us = ok[best]["us"] if ok else float("nan")
            bad = [k for k, v in res.items() if "us" in v and not v["bits"]]
            lines.append(
                f"{family:18} {op:20} {base:>13.1f} {best:>24} {us:>8.1f} "
                + (f"DIFFER: {bad}" if bad else "ok")
            )
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'family':18} {'op':20} {'rows':>5} {'bf16 µs':>9} {'fp8 µs':>9} {'fp8/bf16':>8} "
        f"{'bf16 GB/s':>9} {'fp8 GB/s':>9} {'fp8 %peak':>9} {'fp8 TF/s':>8} bits"
    ]
    for family, ops in results["shapes"].items():
        for op, rows in ops.items():
            for r in rows:
                b, f = r["bf16"], r["fp8"]
                ok = "ok" if r["bf16_kernel_bits"] and r["row_alone_bits"] else "DIFFER"
                lines.append(
                    f"{family:18} {op:20} {r['rows']:>5} {b['us']:>9.1f} {f['us']:>9.1f} "
                    f"{r['speedup']:>7.2f}x {b['gb_per_s']:>9.0f} {f['gb_per_s']:>9.0f} "
                    f"{100 * f['of_peak']:>8.0f}% {f['tflop_per_s']:>8.1f} {ok}"
                )
    return "\n".join(lines)


def main() -> None:
    global DEVICE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="folder for results.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--family", action="append", help="only these families (repeatable)")
    p.add_argument("--rows", type=int, action="append", help=f"row counts (default {ROWS})")
    p.add_argument("--reps", type=int, default=40, help="calls captured in one graph")
    p.add_argument("--commit", default="", help="recorded in results.json")
    p.add_argument(
        "--tiles",
        action="store_true",
        help="instead: one row's fp8 tiles of their own against the bf16 tiles (tiles.json)",
    )
    args = p.parse_args()
    shapes = SHAPES
    rows = tuple(args.rows or ROWS)
    if args.smoke:
        DEVICE = "cpu"
        from tensorfold.ops import gpu

        gpu.set_triton(True, on_cpu=True)
        shapes, rows = SMOKE, tuple(args.rows or (1, 8))
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), PEAK_BYTES_PER_S["H100"])
    results: dict[str, Any] = {
        "device": name,
        "peak_gb_per_s": peak / 1e9,
        "commit": args.commit,
        "block": BLOCK,
    }
    started = time.perf_counter()
    key = "tiles" if args.tiles else "shapes"
    results[key] = {}
    with contextlib.ExitStack() as stack:
        if args.smoke:  # the interpreter rounds fp32 -> bf16 as the GPU does
            from tensorfold import testing

            stack.enter_context(testing.interpreter_rounds_like_the_gpu())
        for fi, (family, ops) in enumerate(shapes.items()):
            if args.family and family not in args.family:
                continue
            results[key][family] = {}
            for oi, (op, spec) in enumerate(ops.items()):
                case = Case(spec, seed=1000 * fi + 10 * oi)
                if args.tiles:
                    results[key][family][op] = sweep(case, args.reps)
                else:
                    results[key][family][op] = [measure(case, m, args.reps, peak) for m in rows]
                del case
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
                results["seconds"] = time.perf_counter() - started
                save(results, args)  # a call cut short keeps what it measured
                print(f"{family} {op}: {results['seconds']:.0f} s", file=sys.stderr, flush=True)
    print(sweep_table(results) if args.tiles else table(results))


def save(results: dict[str, Any], args: argparse.Namespace) -> None:
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = "tiles.json" if args.tiles else "results.json"
        (args.out / name).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
