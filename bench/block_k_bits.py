"""Does BLOCK_K change a row's bits? On the GPU, each linear shape's rows (1 and 2048) under
BLOCK_K 64, 128 and 256 with the shipped K split (the same chunk boundaries), and the expert
kernels' one-row layer under few-row tiles of BLOCK_K 64 and 128, each against the shipped
configuration bit for bit; and the one-row expert layer's time under each tile (a graph of calls
over rotating weights, as bench/decode_kernels.py times them).

    python3 bench/block_k_bits.py [--smoke]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import decode_kernels as dk  # noqa: E402
from tensorfold.ops import triton_linear, triton_moe  # noqa: E402


def linear_bits() -> dict:
    res = {}
    for name, (n, k) in {
        "(2048, 2048)": (2048, 2048),
        "(6144, 2048)": (6144, 2048),
        "(512, 2048)": (512, 2048),
    }.items():
        if dk.DEVICE == "cpu":
            n, k = n // 16, k // 8
        w = (torch.randn(n, k, device=dk.DEVICE) * 0.02).to(dk.BF16)
        x = torch.randn(2048 if dk.DEVICE != "cpu" else 40, k, device=dk.DEVICE).to(dk.BF16)
        shipped = triton_linear.tiles_for(n, k)
        splits = triton_linear.splits_of(n, k)
        base1, base = triton_linear.linear(x[:1].contiguous(), w), triton_linear.linear(x, w)
        saved = dict(triton_linear.TUNED)
        row = {"shipped": f"bk{shipped.block_k} splits {splits}"}
        for bk in (64, 128, 256):
            triton_linear.TUNED[(n, k)] = triton_linear.Tiles(
                shipped.block_n, bk, 4, 4, shipped.wave
            )
            if triton_linear.splits_of(n, k) != splits:  # force the shipped split
                row[f"bk{bk}"] = "other split"
                continue
            try:
                one = triton_linear.linear(x[:1].contiguous(), w)
                row[f"bk{bk}"] = {"row1_equal": bool(torch.equal(one, base1))}
                big = triton_linear.linear(x[:64].contiguous(), w)
                row[f"bk{bk}"]["rows64_equal"] = bool(torch.equal(big, base[:64]))
            except Exception as exc:  # a prompt tile that does not fit
                row[f"bk{bk}"] = {"error": str(exc)[:120]}
        triton_linear.TUNED.clear()
        triton_linear.TUNED.update(saved)
        res[name] = row
    return res


def moe_bits_and_times(grid) -> dict:
    res = {}
    saved = (
        triton_moe.TINY_SWIGLU_TILES,
        triton_moe.TINY_DOWN_TILES,
        triton_moe.TINY_LONG_DOWN_TILES,
    )
    for name, shape in [("lfm2 8B moe", dk.MOE["lfm2 8B moe"])]:
        if dk.DEVICE == "cpu":
            shape = (4, 64, 128, 2)
        sets, x, layer = dk.moe_layer(*shape)
        x1 = x[5:6].contiguous()
        base = layer(x1, sets[0])
        big = layer(x, sets[0])
        row = {
            "shipped_us": dk.graph_us([lambda s=s: layer(x1, s) for s in sets]),
            "shipped_equal_2048": bool(torch.equal(base, big[5:6])),
        }
        for bn, bk, warps, st in grid:
            t = triton_moe.Tiles(bn, bk, warps, st)
            triton_moe.TINY_SWIGLU_TILES = triton_moe.TINY_DOWN_TILES = t
            triton_moe.TINY_LONG_DOWN_TILES = t
            label = f"bn{bn} bk{bk} w{warps} s{st}"
            try:
                row[label] = {
                    "equal": bool(torch.equal(layer(x1, sets[0]), base)),
                    "us": dk.graph_us([lambda s=s: layer(x1, s) for s in sets]),
                }
            except Exception as exc:  # a tile Triton cannot build
                row[label] = {"error": str(exc)[:120]}
        (
            triton_moe.TINY_SWIGLU_TILES,
            triton_moe.TINY_DOWN_TILES,
            triton_moe.TINY_LONG_DOWN_TILES,
        ) = saved
        res[name] = row
        if dk.DEVICE == "cpu":
            break
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    grid = list(itertools.product((32,), (64, 128), (2, 4), (4, 6)))
    if args.smoke:
        from tensorfold.ops import gpu

        dk.DEVICE = "cpu"
        gpu.set_triton(True, on_cpu=True)
        grid = grid[:2]
    torch.manual_seed(0)
    res = {"linear": linear_bits()}
    print(json.dumps(res["linear"]), flush=True)
    res["moe"] = moe_bits_and_times(grid)
    for name, row in res["moe"].items():
        print(name, json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "block_k_bits.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
