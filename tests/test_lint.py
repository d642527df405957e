"""CI's lint and type check: `ruff check` and `ruff format --check` over the whole tree and `mypy`
over the package, all with pyproject.toml's settings, run from the repository root whatever the
cwd."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def test_ruff_finds_nothing() -> None:
    done = _run("ruff", "check", ".")
    if done.returncode != 0:
        pytest.fail(f"ruff check . (exit {done.returncode}):\n{done.stdout}{done.stderr}")


def test_ruff_format_changes_nothing() -> None:
    done = _run("ruff", "format", "--check", ".")
    if done.returncode != 0:
        pytest.fail(
            f"ruff format --check . (exit {done.returncode}; `ruff format .` fixes it):\n"
            f"{done.stdout}{done.stderr}"
        )


def test_mypy_finds_nothing() -> None:
    done = _run("mypy")
    if done.returncode != 0:
        pytest.fail(f"mypy (exit {done.returncode}):\n{done.stdout}{done.stderr}")
