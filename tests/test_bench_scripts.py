"""bench/'s runners on the CPU: the server bench (bench/serve_dummy.sh) in its smoke mode against
the demo's shape, bench/limits.py's two ceilings and bench/kv_capacity.py's table at small sizes,
and every shell script of bench/ parses and names only paths that exist (the GPU suite's and the
device runner's install steps need the GPU machine's wheels, so only that much runs here). No
time is asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import ROOT, run_bench

from tensorfold.testing import clean_env, free_port

SCRIPTS = sorted(ROOT.glob("bench/**/*.sh"))
NAMED = re.compile(r"\b((?:bench|tests|plugins)/[\w/.-]*\w)")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_shell_script_parses_and_names_paths_that_exist(script: Path) -> None:
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    missing = [p for p in NAMED.findall(text) if "*" not in p and not (ROOT / p).exists()]
    assert not missing, missing


def test_the_gpu_suite_and_the_device_runner_are_among_them() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"bench/gpu_suite.sh", "bench/device_run.sh", "bench/serve_dummy.sh"} <= names


def test_the_server_bench_serves_the_demo_shape_and_its_gate_holds(tmp_path: Path) -> None:
    env = clean_env(
        SMOKE="1",
        PORT=str(free_port()),
        OUT=str(tmp_path),
        TF_MEMORY_LIMIT_GIB="1",
        TF_DEMO_CACHE=str(tmp_path / "demo"),
        PATH=f"{Path(sys.executable).parent}:{clean_env()['PATH']}",  # its python3 is ours
    )
    done = subprocess.run(
        ["bash", "bench/serve_dummy.sh", "demo"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "bench_openai.txt").read_text().splitlines()[-1])
    assert report["failed"] == 0 and len(report["rows"]) == 2, report
    assert all(r["tokens"] == 16 and isinstance(r["decode_tok_s"], float) for r in report["rows"])
    gate = (tmp_path / "bench_concurrent.txt").read_text().splitlines()[-1]
    assert gate == "equal 24, unequal 0, failed 0", gate
    assert "serve exit 0" in (tmp_path / "serve_stdout.txt").read_text()


def test_the_limits_measure_on_the_cpu_at_small_sizes() -> None:
    out = run_bench(["bench/limits.py", "--device", "cpu", "--gib", "0.001", "--n", "64"], 300)
    got = json.loads(out)
    assert got["copy"]["bytes_moved"] == 4 * (int(0.001 * 2**30) // 2)  # read + written, bf16
    assert isinstance(got["copy"]["tb_per_s"], float) and got["matmul"]["n"] == 64
    assert isinstance(got["matmul"]["tflops"], float)


def test_the_capacity_table_prints_every_one_gpu_shape_in_both_dtypes() -> None:
    out = run_bench(["bench/kv_capacity.py", "--memory-gib", "96", "--window", "8192"], 300)
    rows = [line.split() for line in out.splitlines()[1:] if line[:1] != " "]
    shapes = ("LFM2-8B-A1B", "LFM2-24B-A2B", "Gemma-4-26B-A4B", "GLM-5.3-Flash-8L")
    assert [(r[0], r[1]) for r in rows] == [(s, kv) for s in shapes for kv in ("bf16", "fp8")]
    assert all(int(r[-1]) > 0 for r in rows)


def test_the_verify_rows_bench_prints_a_table_a_family_on_the_cpu(tmp_path: Path) -> None:
    """bench/verify_rows.py --smoke: each family's smoke shape, one stream, passes of k + 1 rows
    against a one-row pass (torch ops on the CPU, one timed run each)."""
    out = run_bench(
        [
            "bench/verify_rows.py",
            "--smoke",
            "--max-k",
            "2",
            "--warm",
            "0",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        300,
    )
    got = json.loads((tmp_path / "results.json").read_text())
    for family in ("lfm2_moe", "glm5_next", "gemma4"):
        assert [v["rows"] for v in got[family]["verify"]] == [2, 3], got[family]
        assert out.count(f"{family} (smoke, one stream at row 40)") == 1, out


def test_the_fp8_kernel_bench_times_the_families_real_shapes() -> None:
    """bench/fp8_kernels.py's shapes are those of each family's speed shape (dummy.SHAPES)."""
    pytest.importorskip("triton", reason="the bench imports the Triton kernels")
    from bench import fp8_kernels
    from tensorfold_gemma4.dummy import SHAPES as GEMMA
    from tensorfold_glm.dummy import SHAPES as GLM
    from tensorfold_lfm2_moe.dummy import SHAPES as LFM2

    c = LFM2["LFM2-8B-A1B"]
    h, qkv = c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    lfm2 = {
        "conv in_proj": ("linear", 3 * h, h),
        "q+k+v": ("linear", qkv, h),
        "o / conv out_proj": ("linear", h, h),
        "dense FFN": ("dense", c.intermediate_size, h),
        "experts": ("moe", c.num_experts, c.moe_intermediate_size, h, c.num_experts_per_tok),
    }
    g = GEMMA["Gemma-4-26B-A4B"]
    sliding = next(layer for layer in g.layers if layer.kind == "sliding_attention")
    full = next(layer for layer in g.layers if layer.kind == "full_attention")
    gh, heads = g.hidden_size, g.num_attention_heads
    gemma = {
        "q+k+v (sliding)": ("linear", (heads + 2 * sliding.kv_heads) * sliding.head_dim, gh),
        "q+k (full)": ("linear", (heads + full.kv_heads) * full.head_dim, gh),
        "o (sliding)": ("linear", gh, heads * sliding.head_dim),
        "dense FFN": ("dense", sliding.mlp_size, gh),
        "experts": ("moe", g.num_experts, g.moe_intermediate_size, gh, g.top_k_experts),
    }
    m = GLM["GLM-5.3-Flash-8L"]
    mh, kda = m.hidden_size, m.linear_num_heads * m.linear_head_dim
    mla = m.num_attention_heads * m.qk_nope_head_dim
    glm = {
        "KDA q+k+v": ("linear", 3 * kda, mh),
        "KDA o": ("linear", mh, kda),
        "MLA q_a": ("linear", m.q_lora_rank, mh),
        "MLA q_b": ("linear", mla, m.q_lora_rank),
        "MLA o": ("linear", mh, m.num_attention_heads * m.v_head_dim),
        "dense FFN": ("dense", m.intermediate_size, mh),
        "shared expert": ("dense", m.moe_intermediate_size * m.n_shared_experts, mh),
        "experts": ("moe", m.n_routed_experts, m.moe_intermediate_size, mh, m.num_experts_per_tok),
    }
    assert fp8_kernels.SHAPES == {
        "LFM2-8B-A1B": lfm2,
        "Gemma-4-26B-A4B": gemma,
        "GLM-5.3-Flash-8L": glm,
    }


def test_the_speed_benches_count_fp8_weights_as_stored() -> None:
    """--quantization fp8 (bench/verify_rows.py's build, as the speed scripts build): each
    family's smoke model holds fp8 linears, and the decode step's bytes count them as stored
    (values and scales: fewer bytes than bf16's), the active parameters as bf16's."""
    from bench.glm_speed import step_bytes as glm_step_bytes
    from bench.model_bytes import active_params, step_bytes
    from bench.verify_rows import FAMILIES, build
    from tensorfold.ops.fp8 import Fp8Weight
    from tensorfold.testing import weight_leaves

    for family in FAMILIES:
        plain, fp8 = (build(family, True, "cpu", q) for q in ("auto", "fp8"))
        assert any(isinstance(w, Fp8Weight) for w in weight_leaves(fp8.weights).values())
        count = glm_step_bytes if family == "glm5_next" else step_bytes
        a, b = count(plain), count(fp8)
        for key in ("one_stream", "all_experts", "weights_total"):
            assert b[key] < a[key], (family, key)
        if family != "glm5_next":
            assert active_params(fp8) == active_params(plain), family
