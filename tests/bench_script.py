"""A bench script run as a user runs it, for the smoke tests of bench/ (tests/test_bench_*.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tensorfold.testing import clean_env

ROOT = Path(__file__).resolve().parents[1]


def run_bench(args: list[str], timeout: float) -> str:
    """`python ARGS` from the repository root without TF_* settings: its stdout, once it has
    exited 0 (its stderr's end in the failure otherwise)."""
    done = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
