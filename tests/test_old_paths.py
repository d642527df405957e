"""The flat paths the modules had before they had rooms (`tensorfold.model`, `tensorfold.runner`,
...) still import, as the very module of their new home, through tensorfold/__init__.py's alias
table; and nothing in the repository uses them any more (this file excepted)."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tensorfold

ROOT = Path(__file__).parents[1]
OLD = {name.split(".", 1)[1] for name in tensorfold.MOVED}
# A string that is a module path, maybe with an attribute (`tensorfold.x.y`, `tensorfold.x:f`)
DOTTED = re.compile(r"tensorfold(\.\w+)+(:\w+)?")


@pytest.mark.parametrize("old, new", sorted(tensorfold.MOVED.items()))
def test_an_old_path_imports_as_its_new_home(old: str, new: str) -> None:
    home = importlib.import_module(new)
    assert importlib.import_module(old) is home
    assert sys.modules[old] is home and home.__name__ == new and home.__spec__.name == new
    assert getattr(tensorfold, old.split(".")[1]) is home
    parent, _, leaf = old.rpartition(".")
    exec(f"from {parent} import {leaf} as via_from", scope := {})
    assert scope["via_from"] is home


def test_the_packages_that_took_a_modules_name_export_its_names() -> None:
    from tensorfold.cli import main
    from tensorfold.engine import Engine
    from tensorfold.family import FamilySpec
    from tensorfold.server import create_app

    assert main is importlib.import_module("tensorfold.cli.commands").main
    assert Engine is importlib.import_module("tensorfold.engine.engine").Engine
    assert FamilySpec is importlib.import_module("tensorfold.family.spec").FamilySpec
    assert create_app is importlib.import_module("tensorfold.server.app").create_app


def test_importing_tensorfold_loads_no_torch() -> None:
    code = (
        "import sys, tensorfold, tensorfold.family, tensorfold.engine, tensorfold.server; "
        "import tensorfold.cli, tensorfold.hookspecs, tensorfold.server.prompt_work; "
        "assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _old_uses(path: Path) -> list[str]:
    """Imports of an old path in a Python file, and strings that are one (monkeypatch targets,
    `python -m` arguments); log channel names (get_logger's argument) are not module paths."""
    tree = ast.parse(path.read_text())
    found = []
    loggers = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "get_logger"
        for arg in node.args
    }
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in loggers and DOTTED.fullmatch(node.value):
                names = [re.split(r"[:]", node.value)[0]]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tensorfold" and len(parts) > 1 and parts[1] in OLD:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    return found


def test_nothing_in_the_repository_uses_an_old_path() -> None:
    found = []
    for top in ("core", "adapters", "plugins", "tests", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path not in (Path(__file__), ROOT / "core" / "__init__.py"):
                found += _old_uses(path)
    assert not found, "\n".join(found)


def test_the_old_path_check_can_fail(tmp_path: Path) -> None:
    sample = ROOT / "tests" / "_old_path_sample.py"
    try:
        sample.write_text(
            "import tensorfold.runner\nfrom tensorfold import lanes\n"
            "TARGET = 'tensorfold.sampling.ROW_KERNEL'\nlog = get_logger('tensorfold.lanes')\n"
        )
        assert len(_old_uses(sample)) == 3
    finally:
        sample.unlink()
