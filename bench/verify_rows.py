"""A verify pass against a one-row pass, for each family's speed shape at one stream (issue 57:
a stream's token and k drafts checked as k + 1 rows of one pass, for about one weight read).

For each family its speed shape (bench/lfm2_speed.py's LFM2-8B-A1B, glm_speed.py's
GLM-5.3-Flash-8L, gemma4_speed.py's Gemma-4-26B-A4B) with dummy bf16 weights on the GPU, one
stream prefilled `--context` rows, then passes at that position, each timed with CUDA events
after `--warm` untimed ones, the median of `--repeats`:
- one row (logits "last"), eager and replayed from a CUDA graph (as plain decoding runs);
- k + 1 rows with logits "all" and taps at the k draft rows, marked rewind (a verify run as the
  lanes feed it): as served (replayed from a (1, k + 1) graph where the family has verify graphs
  and k + 1 is one of cuda_graphs.VERIFY_ROWS, else eager) and eagerly, and the same rows without
  taps, eagerly (what the taps cost), for k = 1 .. `--max-k`.
Rerunning a pass at one position rewrites the same rows; the fixed state moves on, which changes
no launch. Prints a table a family (ms, and the verify pass over the graphed one-row pass) and
writes results.json to --out.

    python bench/verify_rows.py --out $OUT --family lfm2_moe --commit $(git rev-parse --short HEAD)
    python bench/verify_rows.py --smoke    # every family at its speed script's smoke shape, CPU
    python bench/verify_rows.py --quantization fp8 ...   # the linears in fp8 (docs/fp8.md)

glm5_next's shape is ~76 GB: one family a run (--family) on an 80 GB card, with fla-core
installed (its prefill's whole chunks take chunk_kda).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.family.forward_pass import StreamRows  # noqa: E402

PAGE_ROWS = 512
FAMILIES = ("lfm2_moe", "glm5_next", "gemma4")
SHAPE_NAMES = {
    "lfm2_moe": "LFM2-8B-A1B",
    "glm5_next": "GLM-5.3-Flash-8L",
    "gemma4": "Gemma-4-26B-A4B",
}


def build(family: str, smoke: bool, device: str, quantization: str = "auto") -> Any:
    """The family's speed shape (or its speed script's smoke shape) with dummy weights, its
    linears in fp8 with quantization="fp8" (as --quantization fp8 loads them)."""
    q = quantization
    if family == "lfm2_moe":
        from tensorfold_lfm2_moe.dummy import SHAPES, build_dummy

        cfg: Any = SHAPES[SHAPE_NAMES[family]]
        if smoke:
            from bench.lfm2_speed import smoke_config

            cfg = smoke_config(cfg)
        return build_dummy(cfg, device, torch.bfloat16, seed=0, quantization=q)
    if family == "glm5_next":
        from tensorfold_glm.config import GlmConfig
        from tensorfold_glm.dummy import SHAPES as GLM_SHAPES
        from tensorfold_glm.dummy import build_dummy as glm_dummy

        if smoke:
            from bench.glm_speed import SMOKE_CONFIG

            return glm_dummy(
                GlmConfig.from_dict(SMOKE_CONFIG, "smoke"), device, torch.bfloat16, quantization=q
            )
        return glm_dummy(
            GLM_SHAPES[SHAPE_NAMES[family]], device, torch.bfloat16, seed=0, quantization=q
        )
    from tensorfold_gemma4.config import Gemma4Config
    from tensorfold_gemma4.dummy import SHAPES as GEMMA_SHAPES
    from tensorfold_gemma4.dummy import build_dummy as gemma_dummy

    if smoke:
        from bench.gemma4_speed import SMOKE

        return gemma_dummy(
            Gemma4Config.from_dict(SMOKE, "smoke"), device, torch.bfloat16, quantization=q
        )
    return gemma_dummy(
        GEMMA_SHAPES[SHAPE_NAMES[family]], device, torch.bfloat16, seed=0, quantization=q
    )


def median_ms(fn: Callable[[], Any], device: str, warm: int, repeats: int) -> float:
    """fn's median time in ms over `repeats` runs after `warm` untimed ones: CUDA events around
    each run on the GPU (host launch gaps included), the wall clock on the CPU."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            a = time.perf_counter()
            fn()
            times.append((time.perf_counter() - a) * 1e3)
    return statistics.median(times)


def measure(family: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    from tensorfold.engine.cuda_graphs import GraphRunner

    model = build(family, args.smoke, device, args.quantization)
    vocab = model.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(vocab, 700), (args.context + args.max_k + 1,), generator=g).tolist()
    rows = args.context + args.max_k + 1
    pages = list(range(-(-rows // PAGE_ROWS)))
    runner_cls = GraphRunner if device == "cuda" else ModelRunner
    runner = runner_cls(model, num_pages=len(pages), num_slots=1, page_rows=PAGE_ROWS)
    for a in range(0, args.context, 2048):  # the prompt, in passes of at most 2048 rows
        b = min(args.context, a + 2048)
        runner.run([StreamRows(0, a, ids[a:b], pages, "none")])
    pos = args.context

    def one_row(eager: bool) -> Callable[[], Any]:
        run = ModelRunner.run.__get__(runner) if eager else runner.run
        return lambda: run([StreamRows(0, pos, ids[pos : pos + 1], pages)])

    def rows_of(k: int, taps: bool, eager: bool = False) -> Callable[[], Any]:
        tapped = range(pos + 1, pos + k + 1) if taps else ()
        run = StreamRows(0, pos, ids[pos : pos + k + 1], pages, "all", tapped, rewind=taps)
        go = ModelRunner.run.__get__(runner) if eager else runner.run
        return lambda: go([run])

    timing = dict(device=device, warm=args.warm, repeats=args.repeats)
    one = {"eager": median_ms(one_row(True), **timing)}
    one["graph"] = median_ms(one_row(False), **timing) if device == "cuda" else one["eager"]
    verify = []
    for k in range(1, args.max_k + 1):
        replays = getattr(runner, "replays", 0)
        tapped = median_ms(rows_of(k, True), **timing)
        graphed = getattr(runner, "replays", 0) > replays
        eager = median_ms(rows_of(k, True, eager=True), **timing) if graphed else tapped
        untapped = median_ms(rows_of(k, False, eager=True), **timing)
        verify.append(
            dict(
                k=k,
                rows=k + 1,
                graphed=graphed,
                taps_ms=tapped,
                eager_ms=eager,
                no_taps_ms=untapped,
            )
        )
    res = {
        "shape": "smoke" if args.smoke else SHAPE_NAMES[family],
        "context": args.context,
        "one_row_ms": one,
        "verify": verify,
    }
    return res


def table(family: str, res: dict[str, Any]) -> str:
    one = res["one_row_ms"]
    lines = [
        f"{family} ({res['shape']}, one stream at row {res['context']}): one-row pass "
        f"{one['eager']:.3f} ms eager, {one['graph']:.3f} ms graphed",
        f"{'k':>3} {'rows':>5} {'graphed':>8} {'verify ms':>10} {'eager ms':>9} "
        f"{'no taps ms':>11} {'/ 1-row graph':>14}",
    ]
    for v in res["verify"]:
        lines.append(
            f"{v['k']:>3} {v['rows']:>5} {str(v['graphed']):>8} {v['taps_ms']:>10.3f} "
            f"{v['eager_ms']:>9.3f} {v['no_taps_ms']:>11.3f} {v['taps_ms'] / one['graph']:>14.2f}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--family", default="all", choices=("all", *FAMILIES))
    ap.add_argument("--context", type=int, default=None, help="rows before the timed passes")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--warm", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="smoke shapes on the CPU, torch ops")
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: the linears in fp8 with 128 x 128 block scales (as --quantization fp8)",
    )
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        torch.set_num_threads(1)
    args.context = args.context or (40 if args.smoke else 1024)
    args.warm = args.warm if args.warm is not None else (1 if args.smoke else 5)
    args.repeats = args.repeats or (3 if args.smoke else 21)
    run_families(args, device, measure, table)


def run_families(
    args: argparse.Namespace,
    device: str,
    measure: Callable[[str, argparse.Namespace, str], dict[str, Any]],
    table: Callable[[str, dict[str, Any]], str],
) -> None:
    """`measure` each family `args.family` names (one at a time: a shape may fill the GPU),
    print its `table`, and write every result to `args.out`/results.json."""
    families = FAMILIES if args.family == "all" else (args.family,)
    results: dict[str, Any] = {"commit": args.commit, "device": device}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_properties(0).name
    for family in families:
        with torch.inference_mode():
            results[family] = measure(family, args, device)
        gc.collect()  # the family's model and pool, before the next one's
        if device == "cuda":
            torch.cuda.empty_cache()
        print(table(family, results[family]), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
