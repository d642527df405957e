"""Where a graph round's time goes, from the device trace of one replay: each kernel's share of
the round's wall time, so launches that overlap (dependent launch) or leave the GPU idle between
them (a launch that breaks the dependent chain) are counted as the round sees them.

A kernel's share is how far it moves the round's end: end_i - max(end of the kernels before it),
or 0 when it ends inside one of them. The shares sum to the wall time from the first kernel's
start to the last one's end. Of a share, the part before the kernel's own start is idle time
(no kernel running): the launch gap it waited behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Launch:
    name: str
    grid: str
    ts: float  # start, µs
    dur: float  # µs


def launches(trace: dict[str, Any]) -> list[Launch]:
    """The kernel events of a chrome trace (torch.profiler's export), in start order."""
    out = [
        Launch(
            e["name"][:60],
            "x".join(str(v) for v in e.get("args", {}).get("grid", [])),
            float(e["ts"]),
            float(e["dur"]),
        )
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel"
    ]
    return sorted(out, key=lambda k: k.ts)


def shares(kernels: Iterable[Launch]) -> list[tuple[Launch, float, float]]:
    """(kernel, share of the wall time, idle time before it) in start order."""
    out, end = [], None
    for k in kernels:
        stop = k.ts + k.dur
        if end is None:
            out.append((k, k.dur, 0.0))
            end = stop
            continue
        out.append((k, max(0.0, stop - end), max(0.0, k.ts - end)))
        end = max(end, stop)
    return out


def table(kernels: list[Launch], top: int = 40) -> dict[str, Any]:
    """The round's wall time, its kernels' summed durations and idle time, and the kernels
    grouped by (name, grid), the largest share first: (name, grid, calls, µs each of their own
    duration, share µs, idle µs)."""
    rows = shares(kernels)
    groups: dict[tuple[str, str], list[float]] = {}
    for k, share, idle in rows:
        g = groups.setdefault((k.name, k.grid), [0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[1] += k.dur
        g[2] += share
        g[3] += idle
    ordered = sorted(groups.items(), key=lambda kv: -kv[1][2])
    wall = (max(k.ts + k.dur for k in kernels) - kernels[0].ts) if kernels else 0.0
    return {
        "kernels": len(kernels),
        "wall_us": round(wall, 1),
        "summed_us": round(sum(k.dur for k in kernels), 1),
        "idle_us": round(sum(idle for _, _, idle in rows), 1),
        "groups": [
            (name[:40], grid, int(c), round(d / c, 2), round(s, 1), round(i, 1))
            for (name, grid), (c, d, s, i) in ordered[:top]
        ],
    }
