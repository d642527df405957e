"""The main every family's speed script shares (bench/lfm2_speed.py, gemma4_speed.py,
glm_speed.py): its arguments, the kernels they choose, and its sections run in order into
results.json and summary.txt."""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Iterable
from typing import Any, Callable

from bench.report import summary
from bench.sections import Sections
from tensorfold.ops import gpu

# sections that build transformers' model from our weights, which fp8 weights are not
FP8_SKIPS = ("transformers",)


def speed_arguments(
    description: str,
    shape: str,
    shapes: Iterable[str],
    budget_s: float | None,
    budget_help: str | None = None,
) -> argparse.ArgumentParser:
    """The arguments every family's speed script takes; a script adds its own."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default=os.environ.get("OUT") or "bench_out")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--shape", default=shape, choices=sorted(shapes))
    ap.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)
    ap.add_argument("--sections", default="all")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "fp8"),
        help="fp8: the model's linears in fp8 with 128 x 128 block scales, as --quantization "
        "fp8 loads them (docs/fp8.md); the sections that hand our weights to transformers "
        "are skipped",
    )
    ap.add_argument(
        "--no-triton",
        action="store_true",
        help="the ops' torch references, not Triton's kernels (--smoke: a quick CPU check)",
    )
    return ap


def choose_kernels(args: argparse.Namespace) -> None:
    """--no-triton: the ops' torch references; --smoke: Triton's kernels, interpreted on the
    CPU; else Triton's kernels on the GPU."""
    if args.no_triton:
        gpu.set_triton(False)
    elif args.smoke:
        gpu.set_triton(True, on_cpu=True)


def run_sections(
    bench: Sections,
    plan: list[tuple[str, Callable[[], Any], float]],
    smoke_skips: Collection[str],
    skip: Collection[str] = (),
    extra: Iterable[str] = (),
) -> None:
    """The plan's sections (name, section, seconds it needs) in order: env and build always,
    the others where --sections names them ("all": every one), none in `skip`, none in
    `smoke_skips` on a --smoke run, none in FP8_SKIPS under --quantization fp8. Then the summary, with `extra`'s lines after it, printed
    and written to summary.txt."""
    args = bench.args
    want = set(args.sections.split(",")) if args.sections != "all" else None
    for name, fn, need in plan:
        if name in skip:
            continue
        if name in ("env", "build") or want is None or name in want:
            if args.smoke and name in smoke_skips:
                continue
            if args.quantization == "fp8" and name in FP8_SKIPS:
                continue
            bench.section(name, fn, need)
    text = "\n".join([summary(bench.results), *extra])
    (bench.out / "summary.txt").write_text(text + "\n")
    print(text)
