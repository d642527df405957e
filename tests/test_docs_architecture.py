"""docs/architecture.md's module map names every module of core/ (any depth) and adapters/ and
nothing else, and nothing in the repository points at design documents outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"


def module_map() -> str:
    text = ARCHITECTURE_MD.read_text()
    section = text.split("## Module map", 1)[1]
    return re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)


def named_paths(block: str) -> set[str]:
    """The files the map names: each line's first word, a `dir/` opening a folder at its
    indentation (two spaces a level) and a `name.py` a module in the folder above it. One
    module a line: a second name on a line is not counted."""
    folders: list[str] = []
    named = set()
    for line in block.splitlines():
        words = line.split()
        if not words:
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        folders = folders[:depth]
        if words[0].endswith("/"):
            folders.append(words[0].rstrip("/"))
        elif words[0].endswith(".py"):
            named.add("/".join([*folders, words[0]]))
    return named


def actual_modules() -> set[str]:
    """Every module of core/ (any depth; not core/ops/, whose modules docs/reference.md
    lists) and adapters/."""
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "core").rglob("*.py")}
    found |= {str(p.relative_to(ROOT)) for p in (ROOT / "adapters").glob("*.py")}
    return {m for m in found if not m.startswith("core/ops/")}


def test_the_module_map_names_every_module() -> None:
    named = named_paths(module_map())
    modules = actual_modules()
    missing = modules - named
    assert not missing, f"docs/architecture.md's module map does not name {sorted(missing)}"
    gone = {m for m in named if m.startswith(("core/", "adapters/"))} - modules
    assert not gone, f"docs/architecture.md's module map names modules that do not exist: {gone}"
    for name in ("core/engine/lanes.py", "adapters/paged_kv.py", "core/server/app.py"):
        assert name in named


def test_the_map_reader_sees_folders_and_one_module_a_line() -> None:
    block = "core/   x\n  a.py  y\n  room/\n    b.py c.py\n  d.py\nadapters/\n  e.py\n"
    assert named_paths(block) == {"core/a.py", "core/room/b.py", "core/d.py", "adapters/e.py"}


def test_nothing_points_at_design_documents_outside_the_repository() -> None:
    cited = []
    for path in ROOT.rglob("*"):
        if path.suffix not in (".py", ".md", ".toml") or ".egg-info" in str(path):
            continue
        if path == Path(__file__):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if "families.md" in text or "DESIGN.md" in text:
            cited.append(str(path.relative_to(ROOT)))
    assert not cited, cited


def test_readme_points_at_the_docs() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in ("docs/architecture.md", "docs/plugins.md", "docs/reference.md", "docs/hooks.md"):
        assert doc in readme
        assert (ROOT / doc).is_file()
