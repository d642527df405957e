"""The two ceilings of the GPU at hand, measured: device-to-device copy bandwidth (bytes read +
written) and the bf16 matrix rate of torch.matmul on random data. docs/performance.md's
fractions divide by them.

    python bench/limits.py                                  # on the GPU; prints JSON
    python bench/limits.py --device cpu --gib 0.01 --n 256  # the CPU, small (a smoke test)
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch


def _median_ms(fn: Callable[[], object], device: str, warmup: int = 3, reps: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(gib: float = 4.0, device: str = "cuda") -> dict[str, float]:
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device)
    assert torch.equal(dst[:1000], src[:1000])
    moved = 2 * src.numel() * 2
    return {"bytes_moved": moved, "ms": ms, "tb_per_s": moved / ms / 1e9}


def matmul_rate(n: int = 8192, device: str = "cuda") -> dict[str, float]:
    sets = [
        (
            torch.randn(n, n, device=device, dtype=torch.bfloat16),
            torch.randn(n, n, device=device, dtype=torch.bfloat16),
        )
        for _ in range(3)
    ]
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    i = [0]

    def step():
        a, b = sets[i[0] % 3]
        i[0] += 1
        torch.matmul(a, b, out=out)

    ms = _median_ms(step, device, warmup=5, reps=30)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gib", type=float, default=4.0, help="the copy's size")
    ap.add_argument("--n", type=int, default=8192, help="the matmul's n (n x n by n x n)")
    args = ap.parse_args()
    copy, matmul = copy_bandwidth(args.gib, args.device), matmul_rate(args.n, args.device)
    print(json.dumps({"device": args.device, "copy": copy, "matmul": matmul}))


if __name__ == "__main__":
    main()
