"""docs/architecture.md's module map names every module of core/ and adapters/ and nothing
else, and nothing in the repository points at design documents outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"


def module_map() -> str:
    text = ARCHITECTURE_MD.read_text()
    section = text.split("## Module map", 1)[1]
    return re.search(r"```\n(.*?)```", section, re.DOTALL).group(1)


def test_the_module_map_names_every_module() -> None:
    named = set(re.findall(r"\b(\w+)\.py\b", module_map()))
    modules = {
        p.stem
        for d in ("core", "core/ops", "adapters")
        for p in (ROOT / d).glob("*.py")
        if p.stem != "__init__"
    }
    ops = {m for m in modules if (ROOT / "core" / "ops" / f"{m}.py").exists()}
    missing = modules - ops - named  # the ops are listed in docs/reference.md
    assert not missing, f"docs/architecture.md's module map does not name {sorted(missing)}"
    for name in ("paged_kv", "stream_state", "snapshots"):
        assert name in module_map()
    assert named <= modules | {"__init__"}, named - modules


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
