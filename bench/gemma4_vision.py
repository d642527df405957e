"""Gemma 4's vision tower on one GPU: milliseconds per image at each size Gemma 4's processor
gives (70 .. 1120 soft tokens), and the device memory a run takes against the bound the memory
plan sets aside (VisionConfig.activation_bytes). Dummy bf16 weights (tensorfold_gemma4.dummy)
at the tower's real shape:
Gemma4VisionConfig's defaults (768 wide, 16 layers, 12 heads of 64, patch 16, 3 x 3 pooling)
unless --config names a config.json with a vision_config. The table runs one image a call
(a request of one image). With --prefill, also the first token's time through a runner
(no lanes, no server) on Gemma-4-26B-A4B's text model with dummy weights: a prompt of 2048 rows
holding one 280-row image (the tower, then one pass with the image block) against a text prompt
of the same length. With --batch N, also N images of 70, 140 and 280 soft tokens in one tower
pass (images_embeddings, as encode_media groups them) against N passes of one image, ms per
image either way. Writes gemma4_vision.json to --out and prints tables.

    python bench/gemma4_vision.py --out $OUT [--prefill] [--batch 4]
    python bench/gemma4_vision.py --smoke        # on the CPU, a tiny tower and text model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tensorfold_gemma4.dummy import dummy_vision_weights
from tensorfold_gemma4.vision import image_embeddings, images_embeddings
from tensorfold_gemma4.vision_config import VisionConfig, vision_config
from tensorfold_gemma4.vision_weights import VisionWeights

# soft tokens -> the pooled grid (rows, columns) of an image that gives them
GRIDS = {70: (7, 10), 140: (10, 14), 280: (14, 20), 560: (20, 28), 1120: (28, 40)}
SMOKE_TEXT = {"vocab_size": 262_144, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 1,
              "attention_k_eq_v": True, "sliding_window": 16, "hidden_size_per_layer_input": 0,
              "enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
              "moe_intermediate_size": 32, "use_bidirectional_attention": "vision",
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}  # fmt: skip
SMOKE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "head_dim": 16}  # fmt: skip


def image(cfg: VisionConfig, tokens: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One image's patches [P, 3·patch²] and positions [P, 2] for `tokens` soft tokens."""
    rows, cols = GRIDS[tokens]
    k = cfg.pooling_kernel_size
    ys, xs = torch.meshgrid(torch.arange(rows * k), torch.arange(cols * k), indexing="ij")
    pos = torch.stack((xs.reshape(-1), ys.reshape(-1)), dim=-1).to(device)
    pixels = torch.rand(pos.shape[0], cfg.patch_width, generator=torch.Generator().manual_seed(1))
    return pixels.to(device), pos


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(cfg: VisionConfig, w: VisionWeights, tokens: int, device: str, rounds: int) -> dict:
    px, pos = image(cfg, tokens, device)
    image_embeddings(cfg, w, px, pos)  # warm-up
    sync(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    times = []
    with torch.no_grad():
        for _ in range(rounds):
            start = time.perf_counter()
            out = image_embeddings(cfg, w, px, pos)
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
    assert out.shape == (tokens, cfg.text_hidden_size)
    peak = torch.cuda.max_memory_allocated() - base if device.startswith("cuda") else 0
    patches = pos.shape[0]
    return {
        "soft_tokens": tokens,
        "patches": patches,
        "ms_median": statistics.median(times),
        "ms_min": min(times),
        "peak_bytes": peak,
        "bound_bytes": cfg.activation_bytes(patches, w.input_proj.element_size()),
    }


def measure_batch(
    cfg: VisionConfig, w: VisionWeights, tokens: int, count: int, device: str, rounds: int
) -> dict:
    """ms per image: `count` images of `tokens` soft tokens in one tower pass, and one a pass."""
    images = [image(cfg, tokens, device)] * count

    def one_pass() -> None:
        images_embeddings(cfg, w, images)

    def a_pass_each() -> None:
        for px, pos in images:
            image_embeddings(cfg, w, px, pos)

    out = {"soft_tokens": tokens, "images": count}
    with torch.no_grad():
        for name, fn in (("one_pass", one_pass), ("a_pass_each", a_pass_each)):
            fn()  # warm-up
            times = []
            for _ in range(rounds):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                times.append((time.perf_counter() - start) * 1e3)
            out[f"{name}_ms_per_image"] = statistics.median(times) / count
    return out


def first_token(
    model: Any, tower: VisionWeights, cfg: VisionConfig, rows: int, tokens: int, rounds: int
) -> dict[str, float]:
    """Milliseconds to the first token's logits of a `rows`-row prompt, text only and with one
    image of `tokens` soft tokens from row 100 (the tower, then the pass), median of rounds."""
    from tensorfold.engine.runner import ModelRunner, open_stream
    from tensorfold.family.media import MediaPiece
    from tensorfold_gemma4.media import GemmaImage

    device = str(model.device)
    model.vision_cfg, model.vision_weights = cfg, tower
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 200_000, (rows,), generator=gen).tolist()
    image_token = 258_880
    ids[100 : 100 + tokens] = [image_token] * tokens
    px, pos = image(cfg, tokens, device)
    piece = MediaPiece(100, tokens, 1, GemmaImage(px, pos), block=True)
    runner = ModelRunner(model, num_pages=-(-rows // 512), num_slots=1)

    def once(with_image: bool) -> float:
        sync(device)
        start = time.perf_counter()
        stream = open_stream(runner, 0, rows)
        run = stream.rows(ids)
        if with_image:
            (embeds,) = model.encode_media([piece])
            run = dataclasses.replace(run, embeds=[(100, embeds)], blocks=[(100, 100 + tokens)])
        runner.run([run])
        sync(device)
        stream.lease.release()
        return (time.perf_counter() - start) * 1e3

    out = {}
    with torch.no_grad():
        for name, with_image in (("text", False), ("image", True)):
            once(with_image)  # warm-up: compiles the kernels
            out[f"{name}_ms"] = statistics.median(once(with_image) for _ in range(rounds))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--config", type=Path, default=None, help="a config.json with vision_config")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--prefill", action="store_true", help="time to first token, 26B text model")
    p.add_argument("--batch", type=int, default=0, help="N images in one pass against N passes")
    args = p.parse_args(argv)
    raw: dict[str, Any] = {"vision_config": {}, "text_config": {"hidden_size": 2816}}
    if args.config is not None:
        raw = json.loads(args.config.read_text())
    if args.smoke:
        raw = {"vision_config": SMOKE, "text_config": {"hidden_size": 64}}
    cfg = vision_config(raw)
    assert cfg is not None, "the config has no vision_config"
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    w = dummy_vision_weights(cfg, device, dtype)
    sizes = [70] if args.smoke else sorted(GRIDS)
    rows = [measure(cfg, w, t, device, 1 if args.smoke else args.rounds) for t in sizes]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "vision_config": cfg.__dict__,
        "images": rows,
    }
    print(f"{'soft tokens':>11} {'patches':>8} {'ms/image':>9} {'peak MiB':>9} {'bound MiB':>10}")
    for r in rows:
        print(
            f"{r['soft_tokens']:>11} {r['patches']:>8} {r['ms_median']:>9.2f} "
            f"{r['peak_bytes'] / 2**20:>9.1f} {r['bound_bytes'] / 2**20:>10.1f}"
        )
    if args.batch or args.smoke:
        count = args.batch or 2
        result["batches"] = [
            measure_batch(cfg, w, t, count, device, 1 if args.smoke else args.rounds)
            for t in ([70] if args.smoke else [70, 140, 280])
        ]
        print(f"{'soft tokens':>11} {'images':>6} {'ms/image, one pass':>19} {'a pass each':>12}")
        for r in result["batches"]:
            print(
                f"{r['soft_tokens']:>11} {r['images']:>6} {r['one_pass_ms_per_image']:>19.2f} "
                f"{r['a_pass_each_ms_per_image']:>12.2f}"
            )
    if args.prefill or args.smoke:
        from tensorfold_gemma4.config import Gemma4Config
        from tensorfold_gemma4.dummy import SHAPES, build_dummy

        if args.smoke:  # the 26B's layout at toy widths (bench/gemma4_speed.py's SMOKE)
            small = {**SMOKE_TEXT, "hidden_size": cfg.text_hidden_size}
            text, rows_, tokens = Gemma4Config.from_dict(small, "smoke"), 256, 70
        else:
            text, rows_, tokens = SHAPES["Gemma-4-26B-A4B"], 2048, 280
        model = build_dummy(text, device, dtype)
        result["prefill"] = {
            "prompt_rows": rows_,
            "image_rows": tokens,
            **first_token(model, w, cfg, rows_, tokens, 1 if args.smoke else args.rounds),
        }
        print(f"first token, {rows_} rows: {result['prefill']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemma4_vision.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
