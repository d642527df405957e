"""The frame of a one-call GPU benchmark (bench/*_speed.py): named sections run in order within
a time budget, each one's result (or its traceback) kept in results.json as it ends, so a call
cut short still returns what it measured."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from bench.report import short


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Sections:
    """args: --out, --budget-s and --smoke (the CPU, tiny shapes). Each section returns a
    JSON-able dict."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"args": vars(args)}
        self.t0 = time.perf_counter()
        self.device = "cpu" if args.smoke else "cuda"

    def left(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def section(self, name: str, fn: Callable[[], Any], need_s: float = 0) -> None:
        if self.left() < need_s:
            self.results[name] = {"skipped": f"{self.left():.0f} s left, needs ~{need_s:.0f}"}
            self.log(f"[{name}] skipped")
            return
        a = time.perf_counter()
        self.log(f"[{name}] ...")
        try:
            self.results[name] = fn()
        except Exception:
            self.results[name] = {"error": traceback.format_exc()[-3000:]}
        self.results.setdefault("section_s", {})[name] = round(time.perf_counter() - a, 1)
        self.log(f"[{name}] {time.perf_counter() - a:.1f} s: {short(self.results[name])}")
        self.save()

    def log(self, line: str) -> None:
        print(line, flush=True)
        with open(self.out / "log.txt", "a") as f:
            f.write(line + "\n")

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
