"""docs/plugins.md's plugin runs as written: its file blocks are written into a temporary folder,
the plugin is installed there the way pip records an install (a .dist-info folder with the
pyproject's entry points, on the path), and the plugin's own tests run in a fresh interpreter:
parity with transformers 5.23.0 in fp32, the pass-level gates, and the demo served by the
engine through the `tensorfold` entry-point group."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from guide_blocks import file_blocks, write_blocks

GUIDE = Path(__file__).parents[1] / "docs" / "plugins.md"


def install_in_place(project: Path, site: Path) -> str:
    """Record `project` (a folder with pyproject.toml) as installed into `site`: its packages are
    importable from `project` and its entry points are read from a dist-info, as pip would write
    them. Returns the distribution's name."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    dist = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
             for group, eps in meta.get("entry-points", {}).items()]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    return meta["name"]


def test_the_guide_names_its_files() -> None:
    files = set(file_blocks(GUIDE.read_text()))
    assert {"tiny_dense/pyproject.toml", "tiny_dense/tensorfold_tiny_dense/plugin.py",
            "tiny_dense/tensorfold_tiny_dense/model.py", "tiny_dense/tensorfold_tiny_dense/demo.py",
            "tiny_dense/tests/test_parity.py", "tiny_dense/tests/test_engine.py"} <= files


@pytest.mark.timeout(600)
def test_the_guides_plugin_passes_its_own_tests(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    write_blocks(GUIDE.read_text(), tmp_path)
    project = tmp_path / "tiny_dense"
    site = tmp_path / "site"
    assert install_in_place(project, site) == "tensorfold-tiny-dense"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env["PYTHONPATH"] = os.pathsep.join([str(project), str(site)])
    env["TF_PLUGINS"] = "tiny_dense"  # the guide's plugin alone, found by its entry point
    families = subprocess.run(
        [sys.executable, "-m", "tensorfold.cli", "families"], env=env, cwd=tmp_path,
        capture_output=True, text=True, timeout=120)
    assert families.returncode == 0, families.stderr
    assert "tiny_dense" in families.stdout and "tensorfold-tiny-dense" in families.stdout
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        env=env, cwd=project, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
