"""glm5_next's vision tower: time per image at GLM-5.3-Flash's vision shape (issue 59).

The tower of tensorfold_glm.vision (torch's fused attention, the Triton products) with random
weights at `vision_dummy.REAL` (24 blocks of width 1024, 16 heads, out_hidden_size 4096), in
bf16, on square images of 256, 1024, 4096 and the processor's largest, 8000 rows (merge blocks;
4 patches a row). For each: the median of `--reps` timed calls after two warm-ups (CUDA events,
one image a call: a request of one image), rows per second, the device memory the call took
at its peak, and what the memory plan sets aside for it (vision_memory.tower_activation_bytes).

With `--ttft`, also the time to first token of a one-image prompt against a text prompt of
the same length, at the runner (no server, no lanes): GLM-5.3-Flash's widths with 4 layers
(KDA + dense at 0-2, MLA with the indexer + MoE at 3; about 18 GB in bf16), dummy weights, the
image's tower pass and then the prompt's one pass, against the text prompt's one pass; 32 text
tokens either side of the image.

With `--batch N`, also N images of 256 and 1024 rows in one tower pass (as encode_media groups
them) against N passes of one image: ms per image either way.

    python bench/glm_vision.py --out $OUT       # the table, and glm_vision.json in $OUT
    python bench/glm_vision.py --batch 4 --out $OUT
    python bench/glm_vision.py --ttft --out $OUT
    python bench/glm_vision.py --smoke [--ttft] # tiny shapes on the CPU (the code path runs)
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
TINY_TEXT: dict[str, Any] = {  # one KDA layer and a dense FFN, for --smoke --ttft
    "vocab_size": 96,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "layer_types": ["linear_attention"],
    "mlp_layer_types": ["dense"],
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 4,
    "index_topk": 8,
    "index_kpool": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "hc_sinkhorn_iters": 3,
}
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


def time_batch(weights: Any, rows: int, count: int, reps: int, cuda: bool) -> dict[str, Any]:
    """ms per image: `count` images of about `rows` rows in one tower pass, and one a pass."""
    cfg = weights.cfg
    h, w = grid_for(rows, cfg.spatial_merge_size)
    x = torch.randn(h * w, cfg.patch_dim, device="cuda" if cuda else "cpu")
    one = torch.tensor([[1, h, w]])
    xs, grids = x.repeat(count, 1), one.repeat(count, 1)
    together = timed(lambda: image_embeddings(weights, xs, grids), reps, cuda)
    each = timed(lambda: [image_embeddings(weights, x, one) for _ in range(count)], reps, cuda)
    return {
        "rows": h * w // cfg.spatial_merge_size**2,
        "images": count,
        "one_pass_ms_per_image": round(together / count, 3),
        "a_pass_each_ms_per_image": round(each / count, 3),
    }


def timed(fn: Any, reps: int, cuda: bool) -> float:
    """The median ms of `reps` calls of fn() after two warm-ups."""
    import time

    ms = []
    for i in range(reps + 2):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ms)


def ttft(vision: VisionConfig, reps: int, smoke: bool) -> list[dict[str, Any]]:
    """A one-image prompt's first token (tower, then the prompt's pass) against a text prompt's
    of the same length, at 256 and 1024 image rows."""
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.family.forward_pass import StreamRows
    from tensorfold.family.media import MediaPiece
    from tensorfold_glm.config import GlmConfig
    from tensorfold_glm.dummy import build_dummy
    from tensorfold_glm.media_processor import GlmImage

    cuda = not smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if smoke:
        small = dict(TINY_TEXT, hidden_size=vision.out_hidden_size)
        cfg = GlmConfig.from_dict(small, "tiny")
    else:
        cfg = GlmConfig.from_dict({"num_hidden_layers": 4}, "GLM-5.3-Flash-4L")
    model = build_dummy(cfg, device, dtype)
    model.vision = dummy_vision_weights(vision, device, dtype)
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in (16, 64) if smoke else (256, 1024):
        h, w = grid_for(rows, vision.spatial_merge_size)
        rows = h * w // vision.spatial_merge_size**2
        text = torch.randint(3, cfg.vocab_size, (64 + rows,), generator=gen).tolist()
        ids = text[:32] + [5] * rows + text[32:64]
        pixels = torch.randn(h * w, vision.patch_dim, generator=gen)
        piece = MediaPiece(32, rows, 1, GlmImage(pixels, (1, h, w)))
        pages = -(-len(ids) // 512)
        runner = ModelRunner(model, num_pages=pages, num_slots=1, page_rows=512)

        def image_prompt() -> None:
            (rows_in,) = model.encode_media([piece])
            run = StreamRows(0, 0, ids, list(range(pages)), embeds=[(32, rows_in)])
            runner.run([run])

        def text_prompt() -> None:
            runner.run([StreamRows(0, 0, text, list(range(pages)))])

        image_ms, text_ms = timed(image_prompt, reps, cuda), timed(text_prompt, reps, cuda)
        tower_ms = timed(lambda: model.encode_media([piece]), reps, cuda)
        out.append(
            {
                "prompt_rows": len(ids),
                "image_rows": rows,
                "image_prompt_ms": round(image_ms, 3),
                "text_prompt_ms": round(text_ms, 3),
                "tower_ms": round(tower_ms, 3),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--ttft", action="store_true")
    parser.add_argument("--batch", type=int, default=0, help="N images a pass against N passes")
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
    record: dict[str, Any] = {"device": device, "dtype": str(dtype), "results": results}
    if args.batch or args.smoke:
        count = args.batch or 2
        record["batches"] = [time_batch(weights, r, count, args.reps, cuda) for r in rows[:2]]
        print("\n| rows | images | ms / image, one pass | ms / image, a pass each |")
        print("| ---: | ---: | ---: | ---: |")
        for r in record["batches"]:
            print(
                f"| {r['rows']} | {r['images']} | {r['one_pass_ms_per_image']} | "
                f"{r['a_pass_each_ms_per_image']} |"
            )
    if args.ttft:
        record["ttft"] = ttft(cfg, args.reps, args.smoke)
        print("\n| prompt rows | image rows | image prompt ms | text prompt ms | tower ms |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for r in record["ttft"]:
            print(
                f"| {r['prompt_rows']} | {r['image_rows']} | {r['image_prompt_ms']} | "
                f"{r['text_prompt_ms']} | {r['tower_ms']} |"
            )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "glm_vision.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
