"""glm5_next's vision tower: time per image at GLM-5.3-Flash's vision shape (issue 59).

The tower of tensorfold_glm.vision (torch's fused attention, the Triton products) with random
weights at `vision_dummy.REAL` (24 blocks of width 1024, 16 heads, out_hidden_size 4096), in
bf16, on square images of 256, 1024, 4096 and the processor's largest, 8000 rows (merge blocks;
4 patches a row). For each: the median of `--reps` timed calls after two warm-ups (CUDA events,
one image a call, as encode_media runs them), rows per second, the device memory the call took
at its peak, and what the memory plan sets aside for it (vision_memory.tower_activation_bytes).

    python bench/glm_vision.py --out $OUT       # the table, and glm_vision.json in $OUT
    python bench/glm_vision.py --smoke          # a tiny tower on the CPU (the code path runs)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorfold_glm.vision import image_embeddings  # noqa: E402
from tensorfold_glm.vision_config import VisionConfig  # noqa: E402
from tensorfold_glm.vision_dummy import REAL, dummy_vision_weights  # noqa: E402
from tensorfold_glm.vision_memory import tower_activation_bytes  # noqa: E402

ROWS = (256, 1024, 4096, 8000)
TINY = VisionConfig(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    projection_intermediate_size=64,
)


def grid_for(rows: int, merge: int) -> tuple[int, int]:
    """A grid (h, w) in patches of about `rows` merge blocks, near square, whole blocks."""
    h = max(1, int(rows**0.5))
    w = max(1, rows // h)
    return h * merge, w * merge


def time_one(weights: Any, rows: int, reps: int, cuda: bool) -> dict[str, Any]:
    cfg = weights.cfg
    h, w = grid_for(rows, cfg.spatial_merge_size)
    grid = torch.tensor([[1, h, w]])
    device = "cuda" if cuda else "cpu"
    x = torch.randn(h * w, cfg.patch_dim, device=device)
    ms: list[float] = []
    peak = 0
    for i in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            image_embeddings(weights, x, grid)
            end.record()
            torch.cuda.synchronize()
            if i >= 2:
                ms.append(start.elapsed_time(end))
                peak = max(peak, torch.cuda.max_memory_allocated() - before)
        else:
            import time

            t0 = time.perf_counter()
            image_embeddings(weights, x, grid)
            if i >= 2:
                ms.append((time.perf_counter() - t0) * 1e3)
    rows_made = h * w // cfg.spatial_merge_size**2
    median = statistics.median(ms)
    return {
        "rows": rows_made,
        "patches": h * w,
        "ms": round(median, 3),
        "rows_per_s": round(rows_made / median * 1e3),
        "peak_gib": round(peak / 2**30, 3),
        "plan_gib": round(
            tower_activation_bytes(cfg, rows_made, weights.patch.element_size(), cuda) / 2**30, 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("glm_vision: no CUDA device (--smoke runs a tiny tower on the CPU)")
    cfg, rows = (TINY, (16, 64)) if args.smoke else (REAL, ROWS)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    weights = dummy_vision_weights(cfg, "cuda" if cuda else "cpu", dtype)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    results = [time_one(weights, r, args.reps, cuda) for r in rows]
    print(f"glm5_next vision tower, {cfg.depth} blocks x {cfg.hidden_size}, {dtype}, {device}")
    print("| rows | patches | ms / image | rows / s | peak GiB | plan GiB |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(
            f"| {r['rows']} | {r['patches']} | {r['ms']} | {r['rows_per_s']} | "
            f"{r['peak_gib']} | {r['plan_gib']} |"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"device": device, "dtype": str(dtype), "results": results}
        (args.out / "glm_vision.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
