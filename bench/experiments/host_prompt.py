"""Host work of a prompt pass, on the CPU: the Python of one 2048-row lfm2 pass through the
kernels' launch code, every Triton launch replaced by a stub that returns at once.

On the GPU a 2k prompt pass is bound by the host (docs/journal/sessions.md, session 13: the host
needs about 19 ms to launch its kernels, the kernels about 13 ms). This measures the part of that host time
that is tensorfold's own (argument checks, tile picks, allocations, pass metadata) and not
Triton's launcher, at LFM2-8B-A1B's layer count with narrow widths (the host work does not
depend on the widths).

    python bench/experiments/host_prompt.py              # median of 30 passes, and the Python call count
    python bench/experiments/host_prompt.py --profile    # and cProfile's top functions of one pass

Run without TRITON_INTERPRET (the launches are stubbed, nothing is compiled or interpreted).
A benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton.runtime.jit as triton_jit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the launches are stubbed")

    launches = [0]

    def stub(self, *a, **k):  # a launch that returns at once
        launches[0] += 1

    triton_jit.JITFunction.run = stub
    from tensorfold.engine.runner import ModelRunner
    from tensorfold.family.forward_pass import StreamRows
    from tensorfold.ops import gpu
    from tensorfold_lfm2_moe.dummy import SHAPES, build_dummy

    gpu.set_triton(True, on_cpu=True)
    cfg = replace(
        SHAPES["LFM2-8B-A1B"],
        vocab_size=512,
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        moe_intermediate_size=128,
    )
    model = build_dummy(cfg, "cpu", torch.bfloat16, seed=0)
    pages = -(-args.rows // 512)
    runner = ModelRunner(model, num_pages=pages, num_slots=1, page_rows=512)
    tokens = [10 + i % 400 for i in range(args.rows)]

    def one_pass() -> None:
        runner.run([StreamRows(0, 0, tokens, list(range(pages)))])

    one_pass()
    launches[0] = 0
    times = []
    for _ in range(args.passes):
        a = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - a)
    times.sort()
    per_pass = launches[0] // args.passes
    prof = cProfile.Profile()
    prof.enable()
    one_pass()
    prof.disable()
    stats = pstats.Stats(prof, stream=io.StringIO())
    print(
        f"{args.rows}-row pass: host {times[len(times) // 2] * 1e3:.2f} ms (median of "
        f"{args.passes}; min {times[0] * 1e3:.2f}), {per_pass} launches, "
        f"{stats.total_calls} Python calls"
    )
    if args.profile:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


if __name__ == "__main__":
    main()
