"""docs/hooks.md documents every hookspec with its exact signature, and nothing else."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tensorfold.family import hookspecs

HOOKS_MD = Path(__file__).parents[1] / "docs" / "hooks.md"


def _specs() -> dict[str, Any]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if inspect.isfunction(fn) and hasattr(fn, "tensorfold_spec")
    }


def _typed_signature(name: str, fn: Any) -> str:
    # hookspecs uses `from __future__ import annotations`: annotations are their source text.
    params = ", ".join(f"{p}: {fn.__annotations__[p]}" for p in inspect.signature(fn).parameters)
    return f"def {name}({params}) -> {fn.__annotations__['return']}"


@pytest.fixture(scope="module")
def documented() -> dict[str, str]:
    """Heading name -> the heading's parameter list, from docs/hooks.md."""
    headings = re.findall(r"^## (\w+)\((.*)\)$", HOOKS_MD.read_text(), re.MULTILINE)
    return dict(headings)


@pytest.mark.parametrize("name", sorted(_specs()))
def test_every_hook_is_documented_with_its_signature(name: str, documented: dict[str, str]) -> None:
    fn = _specs()[name]
    assert name in documented, f"docs/hooks.md has no '## {name}(...)' heading"
    assert documented[name] == ", ".join(inspect.signature(fn).parameters)
    assert _typed_signature(name, fn) in HOOKS_MD.read_text().splitlines()


def test_no_documented_hook_is_missing_from_the_specs(documented: dict[str, str]) -> None:
    assert set(documented) <= set(_specs()), "docs/hooks.md documents hooks that do not exist"


@pytest.mark.parametrize("name", sorted(_specs()))
def test_every_hookspec_has_its_docstring(name: str) -> None:
    fn = _specs()[name]
    doc = inspect.getdoc(fn) or ""
    assert ":param" in doc
    firstresult = fn.tensorfold_spec["firstresult"]
    assert doc.endswith("Stops at first non-None result.") == firstresult
    if firstresult:
        assert ":return:" in doc
