"""bench/round_path.py: a graph round's kernels from a device trace, each with its share of the
wall time (overlapping launches counted once, idle gaps charged to the kernel after them)."""

from __future__ import annotations

from bench.round_path import Launch, launches, shares, table


def test_shares_sum_to_the_wall_time_and_charge_gaps_to_the_kernel_after() -> None:
    ks = [
        Launch("a", "1x1x1", 0.0, 5.0),  # 0 .. 5
        Launch("b", "2x1x1", 4.0, 3.0),  # overlaps a (dependent launch): 5 .. 7 is its own
        Launch("c", "1x1x1", 4.5, 1.0),  # ends inside b: no share
        Launch("a", "1x1x1", 9.0, 5.0),
    ]  # 2 µs idle before it
    got = [(k.name, s, i) for k, s, i in shares(ks)]
    assert got == [("a", 5.0, 0.0), ("b", 2.0, 0.0), ("c", 0.0, 0.0), ("a", 7.0, 2.0)]
    t = table(ks)
    assert t["wall_us"] == 14.0 == sum(s for _, s, _ in shares(ks))
    assert t["summed_us"] == 14.0 and t["idle_us"] == 2.0 and t["kernels"] == 4
    assert t["groups"][0] == ("a", "1x1x1", 2, 5.0, 12.0, 2.0)


def test_launches_takes_the_kernel_events_of_a_chrome_trace_in_start_order() -> None:
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "k2", "ts": 20, "dur": 3, "args": {"grid": [4, 1, 1]}},
            {"cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 50},
            {"cat": "kernel", "name": "k1", "ts": 10, "dur": 2, "args": {"grid": [1, 8, 1]}},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 5, "dur": 1},
        ]
    }
    assert launches(trace) == [Launch("k1", "1x8x1", 10.0, 2.0), Launch("k2", "4x1x1", 20.0, 3.0)]
    assert table([]) == {
        "kernels": 0,
        "wall_us": 0.0,
        "summed_us": 0.0,
        "idle_us": 0.0,
        "groups": [],
    }
