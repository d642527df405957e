"""How many streams at a long window the memory plan fits with bf16 and with fp8 KV pages, at a
family's real shape: the weights counted as the family's loader reads them from a checkpoint of
shapes only (bench/fp8_bytes.py: no memory, no GPU), the pages from its state layout as
tensorfold.kv_dtype stores it, the room as tensorfold.start plans it on CUDA (the device's memory
less the weights, the runtime reserve, the activation reserve and the graph runner's scratch page
and slot), no prompt cache.

    python bench/kv_capacity.py [--memory-gib 139.8] [--window 131072] [--weights fp8]
        [--tp N] [--shape NAME ...]

--weights fp8 counts the weights as `--quantization fp8` loads them (the family's fp8_linears in
e4m3 with 128 x 128 scales, the rest in bf16). --tp N counts one rank of N: its slices of the
weights and its state layout, as the family's shard plan cuts them (the plan runs per rank).
GLM-5.3-Flash's MTP layer is not counted (it loads only with --draft mtp).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorfold.engine.start import ACTIVATION_ROWS, CUDA_RESERVE, PAGE_ROWS  # noqa: E402
from tensorfold.family import ShardPlan, StateLayout  # noqa: E402
from tensorfold.memory.kv_dtype import kv_label, kv_layout  # noqa: E402
from tensorfold.memory.kv_plan import GiB, PlanRefused, memory_budget, plan  # noqa: E402

H200_GIB = 139.8  # an H200's memory as CUDA reports it (bench/experiments/kv_fp8.py reads it)
H100_GIB = 79.2  # an H100 80GB's, from its 85.0e9 bytes: not read on our device runs yet
MAX_STREAMS = 4096


def _gemma4(device: str) -> Any:
    import torch

    from tensorfold_gemma4.dummy import SHAPES, build_dummy

    return build_dummy(SHAPES["Gemma-4-26B-A4B"], device, torch.bfloat16, seed=0)


def _lfm2(device: str) -> Any:
    import torch

    from tensorfold_lfm2_moe.dummy import build_dummy

    return build_dummy("LFM2-24B-A2B", device, torch.bfloat16, seed=0)


# shape name -> (family, a builder of its dummy model on a device): bench/experiments/kv_fp8.py
# runs these two through the engine
SHAPES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "Gemma-4-26B-A4B": ("gemma4", _gemma4),
    "LFM2-24B-A2B": ("lfm2_moe", _lfm2),
}


def _counted(family: str) -> tuple[Any, Callable[..., ShardPlan], Callable[..., dict[str, int]]]:
    """A family's (shapes by name, shard plan, fp8_bytes counter)."""
    from bench import fp8_bytes

    if family == "lfm2_moe":
        from tensorfold_lfm2_moe import dummy, shards

        return dummy.SHAPES, shards.plan, fp8_bytes.lfm2
    if family == "gemma4":
        from tensorfold_gemma4 import dummy, shards  # type: ignore[no-redef]

        return dummy.SHAPES, shards.plan, fp8_bytes.gemma4
    from tensorfold_glm import dummy, shards  # type: ignore[no-redef]

    return dummy.SHAPES, shards.plan, lambda shape, world: fp8_bytes.glm(shape, world, mtp=False)


# every shape the table can count -> its family
COUNTED = {
    "LFM2-8B-A1B": "lfm2_moe",
    "LFM2-24B-A2B": "lfm2_moe",
    "Gemma-4-26B-A4B": "gemma4",
    "GLM-5.3-Flash-8L": "glm5_next",
    "GLM-5.3-Flash": "glm5_next",
}
ONE_GPU = ("LFM2-8B-A1B", "LFM2-24B-A2B", "Gemma-4-26B-A4B", "GLM-5.3-Flash-8L")


def room(memory: int, weights: int, stored: StateLayout) -> int:
    """The plan's room on a device of `memory` bytes holding `weights`, as start._room counts it."""
    scratch = stored.page_bytes(PAGE_ROWS) + stored.fixed_bytes
    return memory_budget(
        device_free=memory,
        weights=weights + scratch,
        reserve=CUDA_RESERVE,
        activations=ACTIVATION_ROWS * 64 * 1024,
        limit_gib=None,
    )


def streams_that_fit(stored: StateLayout, room_bytes: int, window: int) -> int:
    """The largest --parallel the plan accepts at `window` in pages mode with no prompt cache
    (every stream at a full window: the pages hold a window a stream); 0 when not one fits."""

    def fits(n: int) -> bool:
        try:
            p = plan(
                room=room_bytes,
                page_rows=PAGE_ROWS,
                page_bytes=stored.page_bytes(PAGE_ROWS),
                fixed_bytes=stored.fixed_bytes,
                window=window,
                lanes=n,
                cache_budget=0,
                paging="on",
                store=False,
            )
        except PlanRefused:
            return False
        return p.windows_held >= n

    lo, hi = 0, MAX_STREAMS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def capacity(layout: StateLayout, weights: int, memory: int, window: int) -> dict[str, Any]:
    """Per KV dtype: bytes a token, a stream at `window` (pages and fixed state) and how many
    streams fit."""
    out: dict[str, Any] = {
        "weights_gib": weights / GiB,
        "memory_gib": memory / GiB,
        "window": window,
    }
    for kv in ("auto", "fp8"):
        stored = kv_layout(layout, kv)
        r = room(memory, weights, stored)
        per_stream = -(-window // PAGE_ROWS) * stored.page_bytes(PAGE_ROWS) + stored.fixed_bytes
        out["bf16" if kv == "auto" else kv] = {
            "stored_as": kv_label(stored),
            "bytes_per_token": stored.row_bytes,
            "stream_gib": per_stream / GiB,
            "room_gib": r / GiB,
            "streams": streams_that_fit(stored, r, window),
        }
    out["ratio"] = out["fp8"]["streams"] / max(out["bf16"]["streams"], 1)
    return out


def shape_capacity(
    shape: str, memory: int, window: int, weights: str = "bf16", tp: int = 1
) -> dict[str, Any]:
    """capacity() at a named shape on one rank of `tp`, its weights counted in bf16 or as
    `--quantization fp8` loads them."""
    family = COUNTED[shape]
    configs, shard_plan, count = _counted(family)
    layout = shard_plan(configs[shape], "bfloat16", tp).layout
    held = count(shape, tp)[weights]
    return {"family": family, "tp": tp, **capacity(layout, held, memory, window)}


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'shape':<17} {'KV':<5} {'B/token':>8} {'GiB/stream':>10} {'streams':>8}"]
    for shape, r in results.items():
        for kv in ("bf16", "fp8"):
            c = r[kv]
            lines.append(
                f"{shape:<17} {kv:<5} {c['bytes_per_token']:>8} "
                f"{c['stream_gib']:>10.2f} {c['streams']:>8}"
            )
        rank = f"a rank of --tp {r['tp']}: " if r.get("tp", 1) > 1 else ""
        lines.append(
            f"{'':<17} fp8/bf16 streams {r['ratio']:.2f}x at a {r['window']}-token window"
            f" ({rank}{r['weights_gib']:.1f} GiB of weights in {r['memory_gib']:.1f} GiB)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--memory-gib",
        type=float,
        default=H200_GIB,
        help=f"a card's memory as CUDA reports it (an H200's {H200_GIB}, an H100's {H100_GIB})",
    )
    ap.add_argument("--window", type=int, default=131072)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--tp", type=int, default=1, help="count one rank of this many")
    ap.add_argument(
        "--shape",
        action="append",
        choices=sorted(COUNTED),
        help=f"repeatable; default the shapes one GPU holds: {', '.join(ONE_GPU)}",
    )
    args = ap.parse_args()
    memory = int(args.memory_gib * GiB)
    shapes = args.shape or ONE_GPU
    print(table({s: shape_capacity(s, memory, args.window, args.weights, args.tp) for s in shapes}))


if __name__ == "__main__":
    main()
