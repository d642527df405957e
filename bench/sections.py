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


def captured(fn: Callable[[], Any], warm: Callable[[], Any] | None = None) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, once `warm` (fn itself unless told) has run on a side stream
    and compiled the kernels."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def kernel_table(prof: Any, rounds: int, path: Path) -> list[tuple[str, float, float]]:
    """A torch profile's kernels over `rounds` rounds: (name, µs a round, calls a round), the
    longest first, also written to path as tab-separated µs, calls, name."""
    kern = sorted(
        (
            (e.key, e.device_time_total / rounds, e.count / rounds)
            for e in prof.key_averages()
            if e.device_time_total > 0
        ),
        key=lambda t: -t[1],
    )
    path.write_text("".join(f"{k[1]:.1f}\t{k[2]:.1f}\t{k[0]}\n" for k in kern))
    return kern


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
        from tensorfold.config.settings import Settings
        from tensorfold.ops import gpu

        self.results["dependent_launch"] = Settings().dependent_launch  # TF_DEPENDENT_LAUNCH
        gpu.set_dependent_launch(self.results["dependent_launch"])
        self.results["prefetch_weights"] = Settings().prefetch_weights  # TF_PREFETCH_WEIGHTS
        gpu.set_prefetch_weights(self.results["prefetch_weights"])

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

    def profile(self) -> dict[str, Any]:
        """Kernel times of eager decode rounds at 1, 8 and 64 streams and one 2048-row pass (a
        section of the subclasses that have `self.model` and `self.runner(n, graphs=, window=)`):
        the sum of the device times is what a graph replay would take, less its gaps."""
        from torch.profiler import ProfilerActivity, profile

        from tensorfold.family.forward_pass import StreamRows

        res: dict[str, Any] = {}
        runs = (
            ("decode1", 1, 1, False),
            ("decode1_graph", 1, 1, True),
            ("decode8", 8, 1, False),
            ("decode64", 64, 1, False),
            ("prefill2048", 1, 2048, False),
        )
        for name, n, rows, graphs in runs:
            runner = self.runner(n, graphs=graphs, window=4096)
            g = torch.Generator().manual_seed(7)
            streams = [
                StreamRows(
                    s,
                    0 if rows > 1 else 100,
                    torch.randint(10, self.model.vocab_size, (rows,), generator=g).tolist(),
                    list(range(s * 8, s * 8 + 8)),
                )
                for s in range(n)
            ]
            for _ in range(3 if graphs else 1):  # a graph runner captures on its second round
                runner.run(streams)
            sync(self.device)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    runner.run(streams)
                sync(self.device)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            (self.out / f"profile_{name}.txt").write_text(table)
            kern = kernel_table(prof, 3, self.out / f"kernels_{name}.tsv")
            res[name] = {
                "gpu_us_per_round": sum(k[1] for k in kern if not k[0].startswith("cuda")),
                "kernels_per_round": sum(k[2] for k in kern if not k[0].startswith("cuda")),
                "top": [(k[0][:60], round(k[1], 1), round(k[2], 1)) for k in kern[:12]],
            }
        return res

    def traced_decode_round(self, runner: Any, n: int, warm: int) -> dict[str, Any]:
        """The chrome trace (torch.profiler's export) of one decode round of n streams at
        position 100, after `warm` rounds of the same rows."""
        import tempfile

        from torch.profiler import ProfilerActivity, profile

        from tensorfold.family.forward_pass import StreamRows

        g = torch.Generator().manual_seed(7)
        streams = [
            StreamRows(
                s,
                100,
                torch.randint(10, self.model.vocab_size, (1,), generator=g).tolist(),
                list(range(s * 8, s * 8 + 8)),
            )
            for s in range(n)
        ]
        for _ in range(warm):
            runner.run(streams)
        sync(self.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.run(streams)
            sync(self.device)
        with tempfile.TemporaryDirectory() as d:
            prof.export_chrome_trace(f"{d}/trace.json")
            return json.loads(Path(f"{d}/trace.json").read_text())

    def round_path(self) -> dict[str, Any]:
        """One graph round at 1 and 8 streams as the engine runs it (dependent launch as set),
        from its device trace: the wall time from the first kernel to the last, the kernels'
        summed durations, the idle time between them, and each kernel's share of the wall time
        (bench/round_path.py), grouped by (name, grid); path_N.tsv lists them in launch order
        (start µs, duration, share, idle, grid, name). Where the census' sum of eager kernels
        and the graph's forward differ, this says which launches the difference sits behind."""
        from bench import round_path

        res: dict[str, Any] = {}
        for n in (1, 8):
            runner = self.runner(n, graphs=True, window=4096)
            # a graph runner captures on its second round
            kernels = round_path.launches(self.traced_decode_round(runner, n, warm=3))
            t0 = kernels[0].ts if kernels else 0.0
            (self.out / f"path_{n}.tsv").write_text(
                "".join(
                    f"{k.ts - t0:.2f}\t{k.dur:.2f}\t{s:.2f}\t{i:.2f}\t{k.grid}\t{k.name}\n"
                    for k, s, i in round_path.shares(kernels)
                )
            )
            res[f"streams{n}"] = round_path.table(kernels)
            res[f"streams{n}"]["replays"] = getattr(runner, "replays", None)
            del runner
        return res

    def census(self) -> dict[str, Any]:
        """Every kernel of one eager decode round at 1, 8 and 64 streams with dependent launch
        off, so each launch's time is its own (under PDL a kernel's time includes its wait on
        the one before): census_N.tsv lists them in launch order (µs, grid, name), and the
        result groups them by (name, grid), the longest first. Two rounds warm the kernels
        first."""
        from tensorfold.ops import gpu

        res: dict[str, Any] = {}
        gpu.set_dependent_launch(False)
        try:
            for n in (1, 8, 64):
                runner = self.runner(n, graphs=False, window=4096)
                trace = self.traced_decode_round(runner, n, warm=2)
                kern = sorted(
                    (e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"),
                    key=lambda e: e["ts"],
                )
                lines, groups = [], {}
                for e in kern:
                    grid = "x".join(str(v) for v in e.get("args", {}).get("grid", []))
                    name = e["name"][:60]
                    lines.append(f"{e['dur']:.2f}\t{grid}\t{name}\n")
                    c, t = groups.get((name, grid), (0, 0.0))
                    groups[(name, grid)] = (c + 1, t + e["dur"])
                (self.out / f"census_{n}.tsv").write_text("".join(lines))
                rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
                res[f"streams{n}"] = {
                    "kernels": len(kern),
                    "us": round(sum(e["dur"] for e in kern), 1),
                    "groups": [
                        (k[0][:40], k[1], c, round(t / c, 2), round(t, 1))
                        for k, (c, t) in rows[:40]
                    ],
                }
                del runner
        finally:
            gpu.set_dependent_launch(self.results["dependent_launch"])
        return res
