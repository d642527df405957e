"""The shipped clients against the served demo: `tensorfold bench concurrent` (the concurrency
gate through the server), `tensorfold bench openai`, and `tensorfold exact record|compare`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import LAUNCH, ServedDemo, served


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(tmp_path_factory, "bench", "--parallel", "4")


def tensorfold(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    return subprocess.run(
        [sys.executable, "-c", LAUNCH, *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_bench_concurrent_reports_zero_unequal(server: ServedDemo) -> None:
    r = tensorfold(
        "bench",
        "concurrent",
        "--url",
        server.url,
        "--levels",
        "1,2,4",
        "--alone",
        "--serial",
        "--max-tokens",
        "12",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "equal 48, unequal 0, failed 0" in r.stdout, r.stdout
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["level 4"] == {"equal": 12, "unequal": 0, "failed": 0}
    # stderr is not a terminal: progress as log lines, not a bar; the last says all were sent
    assert "bench concurrent: 60/60 requests" in r.stderr and "it/s" not in r.stderr, r.stderr
    server.wait_even()


def test_bench_openai_reports_speed(server: ServedDemo) -> None:
    r = tensorfold(
        "bench",
        "openai",
        "--url",
        server.url,
        "--prompts",
        "Hello there",
        "One",
        "--max-tokens",
        "16",
        "--repeats",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert "bench openai: 4/4 requests" in r.stderr and "it/s" not in r.stderr, r.stderr
    assert len(rows) == 2 and all(row["decode_tok_s"] > 0 and row["ttft_s"] > 0 for row in rows)


def test_exact_record_and_compare(server: ServedDemo, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        r = tensorfold(
            "exact", "record", "--url", server.url, "--out", str(out), "--max-tokens", "8"
        )
        assert r.returncode == 0, r.stdout + r.stderr
    r = tensorfold("exact", "compare", str(a), str(b))
    assert r.returncode == 0 and "IDENTICAL (0 problem(s), 14 cases)" in r.stdout, r.stdout
    recording = json.loads(b.read_text())
    case = recording["cases"]["p1-seeded"]
    case["token_ids"][3] += 1
    case["sha256"] = "0" * 64
    b.write_text(json.dumps(recording))
    r = tensorfold("exact", "compare", str(a), str(b))
    assert r.returncode == 1 and "p1-seeded: tokens differ from position 3" in r.stdout, r.stdout


def test_clients_refuse_a_dead_server_in_one_line(tmp_path: Path) -> None:
    r = tensorfold("bench", "concurrent", "--url", "http://127.0.0.1:9/v1", "--levels", "1")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    r = tensorfold("exact", "compare", str(tmp_path / "missing.json"), str(tmp_path / "x"))
    assert r.returncode == 2 and "cannot read" in r.stderr
