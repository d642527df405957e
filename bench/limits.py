"""The two ceilings of the GPU at hand, measured (METHOD.md): device-to-device copy bandwidth
(bytes read + written) and the bf16 matrix rate of torch.matmul on random data."""

from __future__ import annotations

import torch


def _median_ms(fn, warmup: int = 3, reps: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth(gib: float = 4.0) -> dict[str, float]:
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src))
    assert torch.equal(dst[:1000], src[:1000])
    moved = 2 * src.numel() * 2
    return {"bytes_moved": moved, "ms": ms, "tb_per_s": moved / ms / 1e9}


def matmul_rate(n: int = 8192) -> dict[str, float]:
    sets = [
        (
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
            torch.randn(n, n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(3)
    ]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    i = [0]

    def step():
        a, b = sets[i[0] % 3]
        i[0] += 1
        torch.matmul(a, b, out=out)

    ms = _median_ms(step, warmup=5, reps=30)
    return {"n": n, "ms": ms, "tflops": 2 * n**3 / ms / 1e9}
