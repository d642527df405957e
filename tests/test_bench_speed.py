"""The three families' speed benches (bench/lfm2_speed.py, gemma4_speed.py, glm_speed.py) on the
CPU: --smoke's tiny models through the ops' torch references (--no-triton; the kernels have
their own interpreter tests), each section asked for ends without a traceback, results.json and
summary.txt have the shape docs/performance.md reads, and the gates hold. No time is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_script import run_bench

# bench -> the sections run (env and build always run); gemma4's transformers section takes
# over a minute on the CPU, so its hf_baseline path is left to the GPU runs
SECTIONS = {
    "lfm2_speed": ("decode", "prefill", "gates", "transformers"),
    "gemma4_speed": ("decode", "prefill", "gates"),
    "glm_speed": ("decode", "prefill", "gates", "transformers"),
}


@pytest.mark.parametrize("bench", sorted(SECTIONS))
def test_the_smoke_run_fills_every_section_it_was_asked_for(bench: str, tmp_path: Path) -> None:
    sections = SECTIONS[bench]
    run_bench(
        [f"bench/{bench}.py", "--smoke", "--no-triton", "--sections", ",".join(sections)]
        + ["--out", str(tmp_path)],
        600,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("env", "build", *sections):
        assert isinstance(results.get(name), dict), (name, results.get(name))
        assert "error" not in results[name] and "skipped" not in results[name], results[name]
    decode = results["decode"]["streams1"]
    assert isinstance(decode["tokens_per_s"], float) and isinstance(decode["forward_ms"], float)
    assert all(isinstance(p["ttft_s"], float) for p in results["prefill"].values())
    gates = {k: v for k, v in results["gates"].items() if "equal" in k}
    assert gates and all(v is True for v in gates.values()), results["gates"]
    if "transformers" in sections:
        compared = results["transformers"]["bf16_ours_vs_transformers"]
        assert {"positions", "logits_rel_err_median", "top1_agreement"} <= set(compared)
    summary = (tmp_path / "summary.txt").read_text()
    assert "decode 1 streams: " in summary and "sections that failed" not in summary
