"""bench/kv_capacity.py on the CPU with small fake memory sizes: streams at a window counted by
the plan with bf16 and with fp8 pages, at a synthetic layout and at Gemma-4-26B-A4B's shape."""

from __future__ import annotations

from bench import kv_capacity
from tensorfold.engine.start import PAGE_ROWS
from tensorfold.family import RowSpec, StateLayout, StateSpec
from tensorfold.memory.kv_dtype import kv_layout
from tensorfold.memory.kv_plan import GiB

LAYOUT = StateLayout(
    paged=tuple(
        RowSpec(f"L{i}.{n}", (8, 64), "bfloat16", fp8=True) for i in range(4) for n in "kv"
    ),
    fixed=(StateSpec("c", (1024,)),),
)


def test_the_room_holds_exactly_the_streams_it_was_sized_for() -> None:
    window, streams, weights = 8192, 5, 3 * GiB
    stored = kv_layout(LAYOUT, "auto")
    per_stream = window // PAGE_ROWS * stored.page_bytes(PAGE_ROWS) + stored.fixed_bytes
    overhead = 10 * GiB - kv_capacity.room(10 * GiB, 0, stored)  # reserves and scratch
    memory = streams * per_stream + weights + overhead
    assert kv_capacity.room(memory, weights, stored) == streams * per_stream
    assert kv_capacity.streams_that_fit(stored, streams * per_stream, window) == streams
    assert kv_capacity.streams_that_fit(stored, streams * per_stream - 1, window) == streams - 1
    got = kv_capacity.capacity(LAYOUT, weights, memory, window)
    assert got["bf16"]["streams"] == streams and got["bf16"]["stream_gib"] == per_stream / GiB
    # a row: 8 heads x 64 e4m3 and 8 float32 scales, 544 bytes where bf16 takes 1024
    assert got["fp8"]["bytes_per_token"] == 8 * 544 and got["fp8"]["streams"] == 9


def test_gemma4_26b_fits_about_twice_the_streams_in_fp8() -> None:
    got = kv_capacity.shape_capacity("Gemma-4-26B-A4B", 64 * GiB, 131072)
    assert abs(got["weights_gib"] - 50.47e9 / GiB) < 0.1  # 25.23B parameters in bf16
    assert got["bf16"]["bytes_per_token"] == 20 * 1024  # 5 full layers x K+V 2 x 512 bf16
    assert (got["bf16"]["streams"], got["fp8"]["streams"]) == (5, 10), got  # 14.8 GiB of room
    lines = kv_capacity.table({"Gemma-4-26B-A4B": got}).splitlines()
    assert lines[1].split()[-1] == "5" and lines[2].split()[-1] == "10"


def test_a_rank_of_tensor_parallel_counts_its_slices_and_its_layout() -> None:
    """GLM-5.3-Flash at --tp 8: a rank holds an eighth of the experts and heads (the embeddings
    and head cut by vocabulary, the norms and router whole), so its weights are a little over an
    eighth of the 626.65 GB; the MLA latent rows are not cut by heads, so a token's row bytes
    stay one rank's whole. In bf16 the weights leave room for one 128k stream on an H100; in
    fp8 for many."""
    from bench import fp8_bytes

    whole = fp8_bytes.glm("GLM-5.3-Flash", 1, mtp=False)["bf16"]
    h100, shape = int(kv_capacity.H100_GIB * GiB), "GLM-5.3-Flash"
    bf16 = kv_capacity.shape_capacity(shape, h100, 131072, "bf16", tp=8)
    fp8 = kv_capacity.shape_capacity(shape, h100, 131072, "fp8", tp=8)
    assert whole / 8 < bf16["weights_gib"] * GiB < whole / 8 * 1.03, bf16["weights_gib"]
    assert 0.5 < fp8["weights_gib"] / bf16["weights_gib"] < 0.52
    one = kv_capacity.shape_capacity(shape, h100, 131072, "bf16")
    assert bf16["bf16"]["bytes_per_token"] == one["bf16"]["bytes_per_token"]
    assert one["bf16"]["streams"] == 0  # 626 GB on one card: nothing fits
    assert bf16["bf16"]["streams"] < 4 < fp8["bf16"]["streams"], (bf16, fp8)
    assert "a rank of --tp 8" in kv_capacity.table({"GLM-5.3-Flash": fp8})


def test_the_device_bench_runs_every_section_on_the_cpu(tmp_path) -> None:
    """bench/experiments/kv_fp8.py --smoke: tiny models on the CPU through the same sections as
    on the GPU; its gates hold and its host tier served the resumed turn."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "bench" / "experiments" / "kv_fp8.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for shape in kv_capacity.SHAPES:
        r = results[shape]
        assert r["gates"]["concurrent_equals_solo"] and r["gates"]["pages_equal_windows_poisoned"]
        fp8 = r["next_turn"]["fp8"]
        assert fp8["resumed_equals_fresh"] and fp8["host_tier"]["host_hit"], fp8
        assert fp8["gpu_store"]["cached"] > 0 and fp8["host_tier"]["cached"] > 0, fp8
        assert {"bf16_streams1", "fp8_streams1"} <= set(r["decode"])
    assert "concurrent==solo True" in (tmp_path / "summary.txt").read_text()
