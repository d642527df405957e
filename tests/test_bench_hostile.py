"""bench/hostile.py: with --small against the CPU demo it replays every hostile case and writes
one row each (case, status, worst stream gap, worst /health time, notes), reporting what the
server answered rather than failing on it; it refuses a host that is not loopback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import ServedDemo

from bench import hostile

ROOT = Path(__file__).resolve().parents[1]
KEY = "hostile-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(tmp_path_factory.mktemp("hostile"), "--parallel", "4", api_key=KEY)
    yield s
    s.stop()


def test_the_small_set_prints_and_writes_one_row_a_case(server: ServedDemo, tmp_path: Path) -> None:
    out = tmp_path / "hostile.tsv"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.hostile",
            "--url",
            server.base,
            "--small",
            "--api-key",
            KEY,
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = out.read_text().splitlines()
    assert tuple(lines[0].split("\t")) == hostile.COLUMNS
    rows = [line.split("\t") for line in lines[1:]]
    assert [r[0] for r in rows] == list(hostile.cases("127.0.0.1"))
    for case, status, gap, health, _notes in rows:
        assert status and status != "401", case  # the key goes with every API request
        assert gap == "-" or gap.isdigit(), (case, gap)
        assert health == "-" or health.isdigit(), (case, health)
    assert all(r[2] != "-" and r[3] != "-" for r in rows)  # both measured beside every case
    printed = run.stdout.splitlines()
    assert printed[0].split() == list(hostile.COLUMNS)
    assert [p.split()[0] for p in printed[1:-1]] == [r[0] for r in rows]
    assert printed[-1].startswith("worst stream gap")
    assert server.proc.poll() is None  # still serving
    server.wait_even(timeout=60)


def test_a_host_that_is_not_loopback_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert hostile.main(["--url", "http://192.0.2.1:8000", "--small"]) == 2
    assert "not a loopback address" in capsys.readouterr().err
    assert hostile.is_loopback("127.0.0.1") and hostile.is_loopback("localhost")
    assert not hostile.is_loopback("192.0.2.1")


def test_the_worst_gap_counts_the_windows_edges() -> None:
    stream = hostile.SteadyStream("http://127.0.0.1:1", "m", 4, 1.0)
    stream.times = [0.0, 1.0, 1.5, 4.0]
    assert stream.worst_gap(1.0, 5.0) == 2.5  # 1.5 -> 4.0
    assert stream.worst_gap(4.5, 9.0) == 4.5  # nothing came after 4.0: the whole window
    stream.times = []
    assert stream.worst_gap(0.0, 1.0) is None  # never sent
