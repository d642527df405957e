"""The GEMMs of a decode round at one row, timed inside CUDA graphs, for each K split.

Timing a 5 µs kernel from Python measures the launch, not the kernel: each variant here is
captured as `reps` back-to-back calls in one CUDA graph, over `copies` rotating weights (more
bytes than the L2 holds), and the replay is timed with events. Each variant is also checked: a
row alone gives the same bits as that row in a 2048-row pass (prompt tiles, the chunks summed in
one program), and the result is within bf16 rounding of the torch product.

    python bench/experiments/decode_kernels.py --out $OUT          # a table on stdout, decode_kernels.json
    python bench/experiments/decode_kernels.py --tiles             # the one-row GEMVs under other tiles and waves

TF_DEPENDENT_LAUNCH and TF_PREFETCH_WEIGHTS apply, as in the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tensorfold.ops import moe, triton_linear, triton_moe, triton_splitk  # noqa: E402

BF16 = torch.bfloat16
L2_BYTES = 60 << 20

LINEAR = {  # name: (N, K)
    "lfm2 conv.in_proj": (6144, 2048),
    "lfm2 conv.out_proj/q/o": (2048, 2048),
    "lfm2 k/v": (512, 2048),
    "lfm2 q+k+v": (3072, 2048),
    "lfm2 lm_head": (65536, 2048),
    "gemma4 q (sliding)": (4096, 2816),
    "gemma4 k/v (sliding)": (2048, 2816),
    "gemma4 o (sliding)": (2816, 4096),
    "gemma4 dense gate/up": (2112, 2816),
    "gemma4 dense down": (2816, 2112),
}
MOE = {  # name: (experts, width, hidden, top_k)
    "lfm2 8B moe": (32, 1792, 2048, 4),
    "gemma4 26B moe": (128, 704, 2816, 8),
    "lfm2 8B dense": (1, 7168, 2048, 1),
}


DEVICE = "cuda"


def graph_us(calls: list[Callable[[], Any]], reps: int = 40, device: str | None = None) -> float:
    """µs a call: `reps` calls (cycling through `calls`) captured in one graph, median of 15
    replays (on the CPU, --smoke: one plain call each, timed by the host clock). device: where
    the calls run (None: this script's DEVICE)."""
    if (device or DEVICE) == "cpu":
        import time

        a = time.perf_counter()
        for c in calls:
            c()
        return 1e6 * (time.perf_counter() - a) / len(calls)
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            calls[r % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def copies_for(nbytes: int) -> int:
    return max(2, min(16, 3 * L2_BYTES // max(nbytes, 1) + 1))


def variants() -> list[tuple[str, dict[str, Any]]]:
    out = [("before: no split, 64-row tile", dict(MAX_SPLITS=1, TINY_BLOCK_M=64))]
    for s in (1, 2, 4, 8, 16):
        out.append((f"split<={s}, 16-row tile", dict(MAX_SPLITS=s, TINY_BLOCK_M=16)))
    return out


def apply(v: dict[str, Any]) -> None:
    triton_splitk.MAX_SPLITS = v["MAX_SPLITS"]
    triton_linear.TINY_BLOCK_M = v["TINY_BLOCK_M"]
    triton_moe.TINY_BLOCK_M = v["TINY_BLOCK_M"]


def linear_rows() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (n, k) in LINEAR.items():
        ws = [
            (torch.randn(n, k, device=DEVICE) * 0.02).to(BF16) for _ in range(copies_for(n * k * 2))
        ]
        x = torch.randn(2048, k, device=DEVICE).to(BF16)
        ref = x[:1].float() @ ws[0].float().t()
        row: dict[str, Any] = {"weight_mb": n * k * 2 / 1e6}
        x1 = x[:1].contiguous()
        row["cublas_us"] = graph_us([lambda w=w: torch.matmul(x1, w.t()) for w in ws])
        for label, v in variants():
            apply(v)
            big = triton_linear.linear(x, ws[0])
            one = triton_linear.linear(x1, ws[0])
            us = graph_us([lambda w=w: triton_linear.linear(x1, w) for w in ws])
            row[label] = {
                "us": us,
                "tb_per_s": n * k * 2 / us / 1e6,
                "splits": triton_linear.splits_of(n, k),
                "row_alone_equal": bool(torch.equal(one, big[:1])),
                "rel_err": rel(one, ref),
                "m8_us": graph_us([lambda w=w: triton_linear.linear(x[:8], w) for w in ws]),
            }
        res[name] = row
    return res


def moe_layer(e: int, i: int, h: int, k: int) -> tuple[list[Any], torch.Tensor, Callable]:
    """A MoE shape's weight sets (more bytes than the L2 holds, to rotate through), 2048 input
    rows, and its layer (route, experts, slot sum; the dense FFN when e == 1): layer(x, set)."""
    sets = []
    for _ in range(max(2, min(6, 3 * L2_BYTES // (3 * min(e, k) * i * h * 2) + 1))):
        gate_up = (torch.randn(e, 2 * i, h, device=DEVICE) * 0.02).to(BF16)
        down = (torch.randn(e, h, i, device=DEVICE) * 0.02).to(BF16)
        sets.append(
            (list(gate_up[:, :i].unbind(0)), list(gate_up[:, i:].unbind(0)), list(down.unbind(0)))
        )
    gate = (torch.randn(e, h, device=DEVICE) * 0.02).to(BF16)
    x = torch.randn(2048, h, device=DEVICE).to(BF16)

    def layer(xx: torch.Tensor, s: Any) -> torch.Tensor:
        if e == 1:
            return moe.gated_ffn(xx, s[0][0], s[1][0], s[2][0])
        wts, ex = moe.route(xx, gate, None, k, norm_topk_prob=True)
        return moe.moe(xx, wts, ex, *s)

    return sets, x, layer


def moe_rows() -> dict[str, Any]:
    res: dict[str, Any] = {}
    for name, (e, i, h, k) in MOE.items():
        layer_bytes = 3 * e * i * h * 2
        sets, x, layer = moe_layer(e, i, h, k)

        row: dict[str, Any] = {"active_mb": 3 * k * i * h * 2 / 1e6, "layer_mb": layer_bytes / 1e6}
        x1 = x[5:6].contiguous()
        # the expert kernels never split K (MAX_SPLITS is the linears'): only the row tile varies
        for label, v in variants()[:2]:
            apply(v)
            big = layer(x, sets[0])
            one = layer(x1, sets[0])
            us = graph_us([lambda s=s: layer(x1, s) for s in sets])
            row[label] = {
                "us": us,
                "tb_per_s": 3 * k * i * h * 2 / us / 1e6,
                "row_alone_equal": bool(torch.equal(one, big[5:6])),
                "m8_us": graph_us([lambda s=s: layer(x[:8], s) for s in sets]),
            }
        res[name] = row
    return res


MOE_GRID = ((16, 32, 64), (2, 4), (3, 5), (64,))  # BLOCK_Ns, warps, stages, BLOCK_Ks
MOE_KERNEL = "both"  # the tiles swept: both kernels' at once, or "swiglu" or "down" alone


def moe_tiles() -> dict[str, Any]:
    """The expert kernels' tiles for a few rows (triton_moe.TINY_*_TILES; MOE_KERNEL says which
    kernel's, the other keeping the shipped tile): each MoE shape's layer at one row, timed in a
    graph, for each tile, and whether the row alone still equals that row in a 2048-row pass
    (and 8 rows theirs); the prompt tiles keep BLOCK_K 64, so a BLOCK_K other than 64 that
    stays equal shows BLOCK_K leaves the k order alone."""
    res: dict[str, Any] = {}
    saved = (
        triton_moe.TINY_SWIGLU_TILES,
        triton_moe.TINY_DOWN_TILES,
        triton_moe.TINY_LONG_DOWN_TILES,
    )
    bns, warps, stages, bks = MOE_GRID
    tiles = [
        triton_moe.Tiles(bn, bk, w, st) for bn in bns for w in warps for st in stages for bk in bks
    ]
    for name, (e, i, h, k) in MOE.items():
        sets, x, layer = moe_layer(e, i, h, k)

        big = layer(x, sets[0])
        x1 = x[5:6].contiguous()
        row: dict[str, Any] = {}
        for t in tiles:
            triton_moe.TINY_SWIGLU_TILES = t if MOE_KERNEL in ("both", "swiglu") else saved[0]
            triton_moe.TINY_DOWN_TILES = t if MOE_KERNEL in ("both", "down") else saved[1]
            triton_moe.TINY_LONG_DOWN_TILES = t if MOE_KERNEL in ("both", "down") else saved[2]
            label = f"bn{t.block_n} bk{t.block_k} w{t.warps} s{t.stages}"
            try:
                equal = bool(torch.equal(layer(x1, sets[0]), big[5:6])) and bool(
                    torch.equal(layer(x[:8].clone(), sets[0]), big[:8])
                )
                row[label] = {
                    "us": graph_us([lambda s=s: layer(x1, s) for s in sets]),
                    "equal": equal,
                }
            except Exception as exc:  # a tile Triton cannot build
                row[label] = {"error": str(exc)[:120]}
        res[name] = row
    (triton_moe.TINY_SWIGLU_TILES, triton_moe.TINY_DOWN_TILES, triton_moe.TINY_LONG_DOWN_TILES) = (
        saved
    )
    return res


BLOCK_VARIANTS = [  # (label, SMALL_BLOCK_M, SMALL_SWIGLU_TILES, SMALL_DOWN_TILES)
    ("64-row blocks (before session 17)", 64, (64, 64, 4, 4), (64, 64, 4, 4)),
    ("16-row, 64x64 w4 s4", 16, (64, 64, 4, 4), (64, 64, 4, 4)),
    ("16-row, 32x64 w2 s5", 16, (32, 64, 2, 5), (32, 64, 2, 5)),
    ("16-row, 32x64 w4 s5", 16, (32, 64, 4, 5), (32, 64, 4, 5)),
    ("16-row, 32x64 w4 s5, down 32x128 s8", 16, (32, 64, 4, 5), (32, 128, 4, 8)),
    ("32-row, 64x64 w4 s4", 32, (64, 64, 4, 4), (64, 64, 4, 4)),
    ("32-row, 32x64 w4 s5", 32, (32, 64, 4, 5), (32, 64, 4, 5)),
]
BLOCK_ROWS = (32, 64, 128)


def moe_blocks() -> dict[str, Any]:
    """Decode-sized passes' expert tiles (more than TINY_ROWS rows, up to SMALL_ROWS): every
    such pass on the row block and tiles of each BLOCK_VARIANTS entry (FEW_PER_EXPERT off), then
    the shipped choice ("shipped"), each MoE shape's layer at BLOCK_ROWS rows, timed in a graph,
    and whether those rows equal the same rows of a 2048-row pass."""
    res: dict[str, Any] = {}
    saved = (
        triton_moe.SMALL_BLOCK_M,
        triton_moe.SMALL_SWIGLU_TILES,
        triton_moe.SMALL_DOWN_TILES,
        triton_moe.FEW_PER_EXPERT,
    )
    variants = [
        (label, bm, triton_moe.Tiles(*sw), triton_moe.Tiles(*dn), 0)
        for label, bm, sw, dn in BLOCK_VARIANTS
    ] + [("shipped", *saved)]
    for name, (e, i, h, k) in MOE.items():
        sets, x, layer = moe_layer(e, i, h, k)
        big = layer(x, sets[0])
        row: dict[str, Any] = {}
        for label, bm, sw, dn, few in variants:
            triton_moe.SMALL_BLOCK_M = bm
            triton_moe.SMALL_SWIGLU_TILES, triton_moe.SMALL_DOWN_TILES = sw, dn
            triton_moe.FEW_PER_EXPERT = few
            cell: dict[str, Any] = {}
            try:
                for r in BLOCK_ROWS:
                    xr = x[:r].contiguous()
                    cell[f"{r}_us"] = graph_us([lambda s=s: layer(xr, s) for s in sets])
                    cell[f"{r}_equal"] = bool(torch.equal(layer(xr, sets[0]), big[:r]))
            except Exception as exc:  # a tile Triton cannot build
                cell["error"] = str(exc)[:160]
            row[label] = cell
        res[name] = row
    (
        triton_moe.SMALL_BLOCK_M,
        triton_moe.SMALL_SWIGLU_TILES,
        triton_moe.SMALL_DOWN_TILES,
        triton_moe.FEW_PER_EXPERT,
    ) = saved
    return res


DENSE = {"gemma4 26B dense": (2112, 2816), "lfm2 8B dense": (7168, 2048)}  # name: (width, hidden)
DENSE_ROWS = {"tiny": (1, 8), "small": (64, 32)}  # the row class: its row counts, timed first
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) a class's candidates for each kernel
DENSE_CANDIDATES = {
    "tiny": [
        (16, bn, bk, w, st)
        for bn, bk, w, st in (
            (32, 64, 2, 5),
            (32, 128, 4, 8),
            (16, 64, 2, 5),
            (16, 64, 4, 8),
            (16, 128, 2, 8),
            (16, 128, 4, 8),
            (16, 128, 4, 4),
        )
    ],
    "small": [
        (64, 64, 64, 4, 4),
        (64, 32, 64, 4, 4),
        (64, 32, 128, 4, 4),
        (64, 16, 64, 4, 4),
        (64, 16, 128, 4, 4),
        (64, 16, 128, 4, 6),
        (32, 16, 128, 4, 6),
        (32, 32, 64, 4, 4),
        (16, 16, 128, 4, 8),
        (16, 32, 64, 2, 5),
    ],
}


def _candidate(kernel: str, bm: int, t: Any, shipped: tuple[int, Any, Any]) -> tuple[int, Any, Any]:
    """A DENSE_TILES entry trying tiles t for one kernel ("swiglu" or "down") beside the other's
    shipped tiles; a block_m other than the shipped one puts both kernels on t."""
    if bm != shipped[0]:
        return (bm, t, t)
    return (bm, t, shipped[2]) if kernel == "swiglu" else (bm, shipped[1], t)


def _with_best(
    shipped: tuple[int, Any, Any], best: dict[str, tuple[float, Any]]
) -> tuple[int, Any, Any]:
    """The shipped entry with each kernel's best equal tiles (µs, tiles) where it has some."""
    return (
        shipped[0],
        best.get("swiglu", (0, shipped[1]))[1],
        best.get("down", (0, shipped[2]))[1],
    )


def _as_python(table: dict[tuple[int, int, str], Any]) -> str:
    """DENSE_TILES entries as the Python that would write them."""
    return (
        "{"
        + ", ".join(
            f"{k!r}: ({v[0]}, Tiles{tuple(vars(v[1]).values())}, Tiles{tuple(vars(v[2]).values())})"
            for k, v in table.items()
        )
        + "}"
    )


def dense_tiles() -> dict[str, Any]:
    """The dense FFN's tiles (triton_moe.DENSE_TILES) for each DENSE shape and row class: each
    kernel's candidates with the other kernel on the experts' tile ("shipped": the tiles without
    a DENSE_TILES entry), the FFN at the class's row counts timed in a graph over rotating
    weights, its rows checked against the same rows of a 2048-row pass; then "best", the fastest
    equal candidates of both kernels together, and "DENSE_TILES", the class's entry as it stands
    (if any). The result's "table" is DENSE_TILES with the best entries, as Python."""
    res: dict[str, Any] = {}
    saved = dict(triton_moe.DENSE_TILES)
    table: dict[tuple[int, int, str], Any] = dict(saved)
    for name, (i, h) in DENSE.items():
        sets, x, layer = moe_layer(1, i, h, 1)
        big = layer(x, sets[0])
        row: dict[str, Any] = {}
        for cls, counts in DENSE_ROWS.items():
            triton_moe.DENSE_TILES = dict(saved)
            triton_moe.DENSE_TILES.pop((i, h, cls), None)
            shipped = triton_moe.pick(counts[0], i, hidden=h)

            def timed(entry: tuple[int, Any, Any]) -> dict[str, Any]:
                triton_moe.DENSE_TILES[(i, h, cls)] = entry
                cell: dict[str, Any] = {}
                try:
                    for r in counts:
                        xr = x[:r].contiguous()
                        cell[f"{r}_us"] = round(
                            graph_us([lambda s=s: layer(xr, s) for s in sets]), 2
                        )
                        cell[f"{r}_equal"] = bool(torch.equal(layer(xr, sets[0]), big[:r]))
                except Exception as exc:  # a tile Triton cannot build
                    cell["error"] = str(exc)[:160]
                return cell

            def label(bm: int, t: Any) -> str:
                return f"bm{bm} bn{t.block_n} bk{t.block_k} w{t.warps} s{t.stages}"

            cells: dict[str, Any] = {"shipped": {"tiles": str(shipped), **timed(shipped)}}
            if (i, h, cls) in saved:
                cells["DENSE_TILES"] = {
                    "tiles": str(saved[(i, h, cls)]),
                    **timed(saved[(i, h, cls)]),
                }
            best: dict[str, tuple[float, Any]] = {}
            for kernel in ("swiglu", "down"):
                for bm, bn, bk, w, st in DENSE_CANDIDATES[cls]:
                    t = triton_moe.Tiles(bn, bk, w, st)
                    entry = _candidate(kernel, bm, t, shipped)
                    cell = timed(entry)
                    cells[f"{kernel} {label(bm, t)}"] = cell
                    us = cell.get(f"{counts[0]}_us")
                    if (
                        us is not None
                        and all(cell.get(f"{r}_equal") for r in counts)
                        and (bm == shipped[0])
                        and (kernel not in best or us < best[kernel][0])
                    ):
                        best[kernel] = (us, t)
            if best:
                entry = _with_best(shipped, best)
                cell = timed(entry)
                cells["best"] = {"tiles": str(entry), **cell}
                if all(cell.get(f"{r}_equal") for r in counts) and cell.get(
                    f"{counts[0]}_us", 1e9
                ) < cells["shipped"].get(f"{counts[0]}_us", 0):
                    table[(i, h, cls)] = entry
            row[cls] = cells
        res[name] = row
    triton_moe.DENSE_TILES = saved
    res["table"] = _as_python(table)
    return res


def dense_split() -> dict[str, Any]:
    """The dense FFN with its products' K split at several DENSE_WAVEs: each DENSE shape's FFN at 1,
    8 and 64 rows timed in a graph over rotating weights, its rows checked against the same rows of
    a 2048-row pass (split alike)."""
    res: dict[str, Any] = {}
    saved = triton_moe.DENSE_WAVE
    for name, (i, h) in DENSE.items():
        sets, x, layer = moe_layer(1, i, h, 1)
        row: dict[str, Any] = {}
        for wave in (128, 256, 512):
            triton_moe.DENSE_WAVE = wave
            big = layer(x, sets[0])
            cell: dict[str, Any] = {
                "splits": (triton_moe.dense_splits(i, h), triton_moe.dense_splits(h, i))
            }
            for r in (1, 8, 64):
                xr = x[:r].contiguous()
                cell[f"{r}_us"] = round(graph_us([lambda s=s: layer(xr, s) for s in sets]), 2)
                cell[f"{r}_equal"] = bool(torch.equal(layer(xr, sets[0]), big[:r]))
            row[f"wave={wave}"] = cell
        res[name] = row
    triton_moe.DENSE_WAVE = saved
    return res


WALK_ROWS = 2048  # a prompt pass
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the walk class's candidates for each kernel
WALK_CANDIDATES = [
    (128, 64, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (128, 64, 64, 4, 4),
    (128, 64, 128, 8, 3),
    (128, 32, 64, 4, 4),
    (64, 128, 64, 4, 3),
    (64, 128, 64, 8, 4),
    (64, 64, 64, 4, 4),
]


def dense_walk() -> dict[str, Any]:
    """The dense FFN's prompt pass with its K split (the walk class of triton_moe.DENSE_TILES):
    each DENSE shape's FFN at WALK_ROWS rows split on the prompt tiles ("shipped"), and split on
    each kernel's candidates (the other kernel on the prompt tiles), then "best", the fastest equal
    candidates of both; each timed in a graph over rotating weights, its rows 0, 0..7 and 0..63
    checked against the same rows run alone (split alike). The result's "table" holds each shape's
    fastest equal entry where faster than "shipped", as Python."""
    res: dict[str, Any] = {}
    saved = dict(triton_moe.DENSE_TILES)
    entries: dict[tuple[int, int, str], Any] = {}
    for name, (i, h) in DENSE.items():
        sets, x, layer = moe_layer(1, i, h, 1)
        x = x[:WALK_ROWS].contiguous()
        key = (i, h, "walk")
        row: dict[str, Any] = {}
        triton_moe.DENSE_TILES.pop(key, None)
        alone = {r: layer(x[:r].contiguous(), sets[0]) for r in (1, 8, 64)}
        shipped = triton_moe.pick(WALK_ROWS, i, hidden=h, split=True)

        def timed(entry: tuple[int, Any, Any] | None) -> dict[str, Any]:
            if entry is None:
                triton_moe.DENSE_TILES.pop(key, None)
            else:
                triton_moe.DENSE_TILES[key] = entry
            try:
                us = round(graph_us([lambda s=s: layer(x, s) for s in sets], 10), 2)
                big = layer(x, sets[0])
                return {
                    "us": us,
                    "equal": all(bool(torch.equal(big[:r], a)) for r, a in alone.items()),
                }
            except Exception as exc:  # a tile Triton cannot build
                return {"error": str(exc)[:160]}

        row["shipped"] = {"tiles": str(shipped), **timed(None)}
        best: dict[str, tuple[float, Any]] = {}
        for kernel in ("swiglu", "down"):
            for bm, bn, bk, w, st in WALK_CANDIDATES:
                t = triton_moe.Tiles(bn, bk, w, st)
                entry = _candidate(kernel, bm, t, shipped)
                cell = timed(entry)
                row[f"{kernel} bm{bm} bn{bn} bk{bk} w{w} s{st}"] = cell
                if (
                    cell.get("equal")
                    and bm == shipped[0]
                    and (kernel not in best or cell["us"] < best[kernel][0])
                ):
                    best[kernel] = (cell["us"], t)
                if (
                    cell.get("equal")
                    and bm != shipped[0]
                    and ("other" not in best or cell["us"] < best["other"][0])
                ):
                    best["other"] = (cell["us"], entry)
        combined = _with_best(shipped, best)
        row["best"] = {"tiles": str(combined), **timed(combined)}
        fastest = [best["other"]] if "other" in best else []  # the fastest equal cell
        if row["best"].get("equal"):
            fastest.append((row["best"]["us"], combined))
        if "swiglu" in best:
            fastest.append((best["swiglu"][0], (shipped[0], best["swiglu"][1], shipped[2])))
        if "down" in best:
            fastest.append((best["down"][0], (shipped[0], shipped[1], best["down"][1])))
        us, entry = min(fastest, key=lambda f: f[0], default=(1e9, None))
        if us < row["shipped"].get("us", 0):
            entries[key] = entry
        res[name] = row
    triton_moe.DENSE_TILES = saved
    res["table"] = _as_python(entries)
    return res


ALIGN_CASES = {
    "gemma4 8 rows": (8, 128, 8),
    "gemma4 64 rows": (64, 128, 8),
    "lfm2 64 rows": (64, 32, 4),
}  # name: (rows, experts, top k)


def align_route() -> dict[str, Any]:
    """A decode pass's routing alone, timed in a graph: triton_align.align of its pairs, and its
    route (gemma4's softmax over 128 experts, lfm2's sigmoid over 32), a program a row."""
    from tensorfold.ops import triton_align, triton_route

    res: dict[str, Any] = {}
    for name, (n, e, k) in ALIGN_CASES.items():
        g = torch.Generator().manual_seed(n + e)
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(DEVICE)
        x = torch.randn(n, 2816 if e == 128 else 2048, device=DEVICE).to(BF16)
        gate = (torch.randn(e, x.shape[1], device=DEVICE) * 0.02).to(BF16)
        scale = torch.ones(e, device=DEVICE)
        row: dict[str, Any] = {
            "align": {
                "us": round(
                    graph_us([lambda: triton_align.align(experts, e, triton_moe.TINY_BLOCK_M)]), 2
                ),
                "equal": True,
            }
        }

        def routed() -> Any:
            if e == 128:
                return triton_route.softmax_route(x, gate, k, scale)
            return triton_route.route(x, gate, None, k, norm_topk_prob=True, scaling=1.0)

        routed()
        row["route"] = {"us": round(graph_us([routed]), 2), "equal": True}
        res[name] = row
    return res


def invariance() -> dict[str, Any]:
    """The shipped configuration: each shape's rows alone and in passes of every size class
    (split grid, 64-row and 128-row tiles) against the same rows in a 2048-row pass."""
    res: dict[str, Any] = {}
    sizes = (1, 2, 8, 16, 17, 64, 256, 257, 700)
    for name, (n, k) in LINEAR.items():
        w = (torch.randn(n, k, device=DEVICE) * 0.02).to(BF16)
        x = torch.randn(2048, k, device=DEVICE).to(BF16)
        big = triton_linear.linear(x, w)
        res[name] = [
            m for m in sizes if not torch.equal(triton_linear.linear(x[:m].clone(), w), big[:m])
        ]
    for name, (e, i, h, k) in MOE.items():
        sets, x, layer_of = moe_layer(e, i, h, k)

        def layer(xx: torch.Tensor) -> torch.Tensor:
            return layer_of(xx, sets[0])

        big = layer(x)
        res[name] = [
            m for m in sizes for _ in range(3) if not torch.equal(layer(x[:m].clone()), big[:m])
        ]
    return res


SWEEP_SHAPES = {  # name: (N, K)
    "lfm2 conv.in_proj": (6144, 2048),
    "lfm2 out_proj/q/o": (2048, 2048),
    "lfm2 k/v": (512, 2048),
    "lfm2 q+k+v": (3072, 2048),
    "gemma4 q": (4096, 2816),
    "gemma4 o": (2816, 4096),
    "gemma4 k/v": (2048, 2816),
    "gemma4 q+k+v": (8192, 2816),
    "gemma4 q+k (full)": (9216, 2816),
    "lfm2 lm_head": (65536, 2048),
    "gemma4 lm_head": (262144, 2816),
    # glm5_next at GLM-5.3-Flash's widths (session 25's census: the o maps at 23 us, x's narrow
    # maps at 5.5, f_b / g_b at 4.5, q_a at 7.4 and kv_a at 5.7, each well above a bare read)
    "glm kda qkv": (24576, 4096),
    "glm kda o": (4096, 8192),
    "glm mla o": (4096, 16384),
    "glm kda x_maps": (320, 4096),
    "glm indexer x_maps": (288, 4096),
    "glm f_b/g_b": (8192, 128),
    "glm f_b+g_b": (16384, 128),  # linear_groups' joint weight (its tiles are this shape's)
    "glm mla q_a": (1536, 4096),
    "glm mla kv_a": (512, 4096),
    "glm mla q_b": (16384, 1536),
    "glm indexer wq_b": (4096, 1536),
}


SWEEP_GRID = (
    (32, 64, 128),
    (64, 128),
    (4,),
    (128, 256),
    (4,),
)  # BLOCK_N, BLOCK_K, stages, wave, warps


def tile_sweep() -> dict[str, Any]:
    """Each shape's one-row GEMV (and 8 and 64 rows) under other tiles and waves (the K split's
    program target): µs a call in a graph, and whether a row alone still equals the row in a
    2048-row pass. BLOCK_K and the split change a shape's bits (for every row count alike)."""
    import itertools

    res: dict[str, Any] = {}
    saved_tuned, saved_wave = dict(triton_linear.TUNED), triton_splitk.WAVE
    for name, (n, k) in SWEEP_SHAPES.items():
        ws = [
            (torch.randn(n, k, device=DEVICE) * 0.02).to(BF16) for _ in range(copies_for(n * k * 2))
        ]
        x = torch.randn(2048 if DEVICE != "cpu" else 300, k, device=DEVICE).to(BF16)
        x1, x8, x64 = x[:1].contiguous(), x[:8].contiguous(), x[:64].contiguous()
        rows = {"shipped": triton_linear.tiles_for(n, k)}
        for bn, bk, st, wave, warps in itertools.product(*SWEEP_GRID):
            rows[f"bn{bn} bk{bk} st{st} wave{wave} w{warps}"] = (
                triton_linear.Tiles(bn, bk, warps, st),
                wave,
            )
        out: dict[str, Any] = {}
        for label, cfg in rows.items():
            triton_linear.TUNED.clear()
            triton_linear.TUNED.update(saved_tuned)
            triton_splitk.WAVE = saved_wave
            if label != "shipped":
                triton_linear.TUNED[(n, k)], triton_splitk.WAVE = cfg
            try:
                big = triton_linear.linear(x, ws[0])
                eq = (
                    bool(torch.equal(triton_linear.linear(x1, ws[0]), big[:1]))
                    and bool(torch.equal(triton_linear.linear(x8, ws[0]), big[:8]))
                    and bool(torch.equal(triton_linear.linear(x64, ws[0]), big[:64]))
                )
                out[label] = {
                    "us": graph_us([lambda w=w: triton_linear.linear(x1, w) for w in ws]),
                    "m8_us": graph_us([lambda w=w: triton_linear.linear(x8, w) for w in ws]),
                    "m64_us": graph_us([lambda w=w: triton_linear.linear(x64, w) for w in ws]),
                    "equal": eq,
                    "splits": triton_linear.splits_of(n, k),
                }
            except Exception as e:  # a tile that does not fit
                out[label] = {"error": str(e)[:120]}
        triton_linear.TUNED.clear()
        triton_linear.TUNED.update(saved_tuned)
        triton_splitk.WAVE = saved_wave
        ok = {lb: r for lb, r in out.items() if "us" in r and r["equal"]}
        best = sorted(ok, key=lambda lb: ok[lb]["us"])[:5]
        res[name] = {"all": out, "best": best}
        print(
            f"{name} ({n}, {k}): shipped {out['shipped'].get('us', 0):.2f} / "
            f"{out['shipped'].get('m8_us', 0):.2f} / {out['shipped'].get('m64_us', 0):.2f} us"
            f" (1 / 8 / 64 rows)",
            flush=True,
        )
        for lb in best:
            r = ok[lb]
            print(
                f"    {lb}: {r['us']:.2f} / {r['m8_us']:.2f} / {r['m64_us']:.2f} us, "
                f"{r['splits']} splits",
                flush=True,
            )
        bad = [lb for lb, r in out.items() if "us" in r and not r["equal"]]
        if bad:
            print(f"    rows unequal: {bad}", flush=True)
    return res


def table(res: dict[str, Any]) -> str:
    lines = []
    for part in ("linear", "moe"):
        for name, row in res[part].items():
            cells = [f"{name:26s}"]
            if "cublas_us" in row:
                cells.append(f"cuBLAS {row['cublas_us']:6.1f}")
            for label, _ in variants():
                if label not in row:
                    continue
                r = row[label]
                eq = "" if r["row_alone_equal"] else "!NEQ"
                cells.append(
                    f"{label.split(',')[0]}: {r['us']:6.1f}us {r['tb_per_s']:4.2f}TB/s{eq}"
                )
            lines.append(" | ".join(cells))
    return "\n".join(lines)


def save(out: str, name: str, res: dict[str, Any]) -> dict[str, Any]:
    """res written to out/name as JSON; returns res."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / name).write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpreted")
    ap.add_argument("--check", action="store_true", help="only the row-invariance check")
    ap.add_argument("--tiles", action="store_true", help="only the one-row GEMVs' tile sweep")
    ap.add_argument(
        "--moe-tiles", action="store_true", help="only the expert kernels' few-row tiles"
    )
    ap.add_argument(
        "--moe-blocks",
        action="store_true",
        help="only the expert kernels' row blocks and tiles for decode-sized passes",
    )
    ap.add_argument(
        "--dense-tiles",
        action="store_true",
        help="only the dense FFN's tiles (triton_moe.DENSE_TILES)",
    )
    ap.add_argument(
        "--dense-walk",
        action="store_true",
        help="only the dense FFN's prompt pass with its K split, over its tiles",
    )
    ap.add_argument(
        "--dense-split",
        action="store_true",
        help="only the dense FFN with its K split at several waves",
    )
    ap.add_argument(
        "--align",
        action="store_true",
        help="only a decode pass's routing: align and route variants",
    )
    ap.add_argument(
        "--grid",
        help="--tiles' grid: BLOCK_Ns;BLOCK_Ks;stages;waves;warps, each "
        "comma-separated (wave 1: no K split), e.g. '16,32;128,256;4,8;1,256;2,4'",
    )
    ap.add_argument("--shapes", help="--tiles' shapes: names of SWEEP_SHAPES, comma-separated")
    ap.add_argument(
        "--moe-grid",
        help="--moe-tiles' grid: BLOCK_Ns;warps;stages[;BLOCK_Ks], "
        "each comma-separated, e.g. '32,64;2,4;5,8;64,128'",
    )
    ap.add_argument(
        "--moe-kernel",
        choices=("both", "swiglu", "down"),
        default="both",
        help="--moe-tiles: whose tiles vary (the other keeps the shipped tile)",
    )
    args = ap.parse_args()
    global SWEEP_GRID, MOE_GRID, MOE_KERNEL
    MOE_KERNEL = args.moe_kernel
    if args.moe_grid:
        parts = [tuple(int(v) for v in part.split(",")) for part in args.moe_grid.split(";")]
        if len(parts) not in (3, 4):
            ap.error(f"--moe-grid takes BLOCK_Ns;warps;stages[;BLOCK_Ks], not {args.moe_grid!r}")
        MOE_GRID = tuple(parts) if len(parts) == 4 else (*parts, (64,))
    if args.grid:
        SWEEP_GRID = tuple(tuple(int(v) for v in part.split(",")) for part in args.grid.split(";"))
    if args.shapes:
        keep = args.shapes.split(",")
        for name in list(SWEEP_SHAPES):
            if name not in keep:
                del SWEEP_SHAPES[name]
    if args.smoke:
        from tensorfold.ops import gpu

        global DEVICE
        DEVICE = "cpu"
        gpu.set_triton(True, on_cpu=True)
        LINEAR.clear()
        LINEAR.update({"tiny": (96, 320)})
        MOE.clear()
        MOE.update({"tiny moe": (6, 96, 320, 2), "tiny dense": (1, 128, 320, 1)})
        DENSE.clear()
        DENSE.update({"tiny dense": (128, 320)})
        DENSE_ROWS.update(tiny=(1, 3), small=(20,))
        global WALK_ROWS
        WALK_ROWS = 300
        del WALK_CANDIDATES[2:]
        for cls in DENSE_CANDIDATES:
            DENSE_CANDIDATES[cls] = DENSE_CANDIDATES[cls][:3]
        SWEEP_SHAPES.clear()
        SWEEP_SHAPES.update({"tiny": (96, 320)})
        SWEEP_GRID = ((32,), (64,), (3,), (128,), (4,))
    from tensorfold.config.settings import Settings
    from tensorfold.ops import gpu

    launch = {
        "dependent_launch": Settings().dependent_launch,  # TF_DEPENDENT_LAUNCH
        "prefetch_weights": Settings().prefetch_weights,
    }  # TF_PREFETCH_WEIGHTS
    gpu.set_dependent_launch(launch["dependent_launch"])
    gpu.set_prefetch_weights(launch["prefetch_weights"])
    print(json.dumps(launch))
    torch.manual_seed(0)
    if args.check:
        print("rows unequal to the 2048-row pass:", json.dumps(invariance()))
        return
    if args.tiles:
        save(args.out, "tile_sweep.json", tile_sweep())
        return
    if args.moe_tiles:
        res = save(args.out, "moe_tiles.json", moe_tiles())
        for name, row in res.items():
            print(
                name,
                " | ".join(
                    f"{k}: {v.get('us', float('nan')):.1f}{'' if v.get('equal') else ' NEQ'}"
                    for k, v in row.items()
                ),
            )
        return
    if args.dense_split:
        res = save(args.out, "dense_split.json", dense_split())
        for name, row in res.items():
            for label, v in row.items():
                cells = " | ".join(
                    f"{r} rows {v[f'{r}_us']:6.2f} us{'' if v[f'{r}_equal'] else ' NEQ'}"
                    for r in (1, 8, 64)
                )
                print(f"{name:16s} {label:22s} splits {v['splits']} {cells}")
        return
    if args.dense_walk:
        res = save(args.out, "dense_walk.json", dense_walk())
        for name, row in res.items():
            if name == "table":
                continue
            for label, v in row.items():
                flag = "" if v.get("equal", True) else " NEQ"
                print(
                    f"{name:16s} {label:34s} {v.get('us', float('nan')):9.2f} us{flag} {v.get('error', '')}"
                )
        print("walk entries:", res["table"])
        return
    if args.align:
        res = save(args.out, "align.json", align_route())
        for name, row in res.items():
            for label, v in row.items():
                print(f"{name:16s} {label:34s} {v['us']:7.2f} us{'' if v['equal'] else ' NEQ'}")
        return
    if args.dense_tiles:
        res = save(args.out, "dense_tiles.json", dense_tiles())
        for name, row in res.items():
            if name == "table":
                continue
            for cls, cells in row.items():
                for label, v in sorted(
                    cells.items(),
                    key=lambda kv: min(
                        (u for k, u in kv[1].items() if k.endswith("_us")), default=1e9
                    ),
                ):
                    times = " | ".join(
                        f"{k[:-3]} rows {u:7.2f} us{'' if v.get(k[:-3] + '_equal') else ' NEQ'}"
                        for k, u in v.items()
                        if k.endswith("_us")
                    )
                    print(f"{name:16s} {cls:5s} {label:40s} {times} {v.get('error', '')}")
        print("DENSE_TILES =", res["table"])
        return
    if args.moe_blocks:
        res = save(args.out, "moe_blocks.json", moe_blocks())
        for name, row in res.items():
            for label, v in row.items():
                cells = [
                    f"{r} rows {v[f'{r}_us']:7.2f} us{'' if v[f'{r}_equal'] else ' NEQ'}"
                    for r in BLOCK_ROWS
                    if f"{r}_us" in v
                ]
                print(f"{name:16s} {label:38s}", " | ".join(cells), v.get("error", ""))
        return
    saved = dict(MAX_SPLITS=triton_splitk.MAX_SPLITS, TINY_BLOCK_M=triton_linear.TINY_BLOCK_M)
    res = save(
        args.out, "decode_kernels.json", {**launch, "linear": linear_rows(), "moe": moe_rows()}
    )
    apply(saved)
    print(table(res))


if __name__ == "__main__":
    main()
