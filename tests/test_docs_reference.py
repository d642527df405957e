"""docs/reference.md lists every public name of the modules a family is built from, each in its
module's section, every module of tensorfold.ops, and every name docs/plugins.md's code imports
(or reaches through a module it imports) in its module's section."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from guide_blocks import check_blocks, file_blocks

import tensorfold.ops

REFERENCE_MD = Path(__file__).parents[1] / "docs" / "reference.md"
GUIDE_MD = Path(__file__).parents[1] / "docs" / "plugins.md"
MODULES = [
    "tensorfold.family",
    "tensorfold.family.model",
    "tensorfold.family.forward_pass",
    "tensorfold.adapters.paged_kv",
    "tensorfold.adapters.stream_state",
    "tensorfold.adapters.snapshots",
    "tensorfold.family.checkpoint",
    "tensorfold.family.rope_config",
    "tensorfold.family.tokenizer",
    "tensorfold.family.demo_build",
    "tensorfold.ops.linear",
    "tensorfold.ops.norms",
    "tensorfold.ops.rope",
    "tensorfold.ops.attention",
    "tensorfold.ops.window_attention",
    "tensorfold.ops.moe",
    "tensorfold.ops.slot_sum",
    "tensorfold.ops.conv",
    "tensorfold.ops.parallel",
    "tensorfold.ops.symmetric_reduce",
    "tensorfold.ops.gpu",
    "tensorfold.ops.pass_meta",
    "tensorfold.ops.kv_quant",
    "tensorfold.ops.fp8",
    "tensorfold.ops.fp8_dispatch",
    "tensorfold.ops.switches",
    "tensorfold.testing",
    "tensorfold.conformance",
    "tensorfold.family.hooks",
    "tensorfold.family.reasoning",
    "tensorfold.engine.ngram_drafts",
    "tensorfold.engine.drafts",
    "tensorfold.family.drafter",
    "tensorfold.engine.runner",
]


# A package that is its contract's public face: its names are defined in this module
FACES = {"tensorfold.family": "tensorfold.family.spec"}


def _public(name: str) -> bool:
    return not name.startswith("_")


def _assigned(node: ast.stmt) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [t.id for t in targets if isinstance(t, ast.Name)]


def public_names(module: str) -> list[str]:
    """Names a module defines (not imports): top-level functions, classes and constants, and
    each class's public methods, fields and the attributes its __init__ sets."""
    source = importlib.import_module(FACES.get(module, module)).__file__
    tree = ast.parse(Path(source).read_text())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _public(node.name):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            names += [n for n in _assigned(node) if _public(n)]
        if not isinstance(node, ast.ClassDef) or not _public(node.name):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and _public(item.name):
                names.append(f"{node.name}.{item.name}")
            elif isinstance(item, ast.AnnAssign) and _public(item.target.id):
                names.append(f"{node.name}.{item.target.id}")
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                for sub in ast.walk(item):
                    if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                        names += [
                            f"{node.name}.{t.attr}"
                            for t in targets
                            if isinstance(t, ast.Attribute)
                            and _public(t.attr)
                            and isinstance(t.value, ast.Name)
                            and t.value.id == "self"
                        ]
    return list(dict.fromkeys(names))


def sections() -> dict[str, str]:
    """Heading `module` -> the text up to the next heading of its level or above."""
    text = REFERENCE_MD.read_text()
    found = list(re.finditer(r"^(#{2,3}) `(tensorfold[\w.]*)`$", text, re.MULTILINE))
    out = {}
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        out[m.group(2)] = text[m.end() : end]
    return out


def mentioned(name: str, text: str) -> bool:
    """`name` as a word inside a code span of `text`."""
    word = re.compile(rf"(?<![\w.]){re.escape(name)}\b")
    return any(word.search(span) for span in re.findall(r"`([^`]+)`", text))


@pytest.mark.parametrize("module", MODULES)
def test_every_public_name_is_listed_in_its_section(module: str) -> None:
    section = sections().get(module)
    assert section is not None, f"docs/reference.md has no '## `{module}`' section"
    missing = [
        n
        for n in public_names(module)
        if not (mentioned(n, section) or mentioned(n.split(".")[-1], section))
    ]
    assert not missing, f"docs/reference.md's {module} section does not list {missing}"


@pytest.mark.parametrize("face, source", sorted(FACES.items()))
def test_a_face_exports_every_public_name_of_its_source(face: str, source: str) -> None:
    names = {n for n in public_names(source) if "." not in n}
    assert "FamilySpec" in names
    exported = importlib.import_module(face)
    assert not [n for n in names if not hasattr(exported, n)], face
    assert sorted(exported.__all__) == sorted(names)


def test_every_ops_module_is_in_the_reference() -> None:
    text = REFERENCE_MD.read_text()
    for info in pkgutil.iter_modules(tensorfold.ops.__path__):
        if info.name.startswith("triton_"):
            assert mentioned(info.name, text), f"{info.name} is not named in docs/reference.md"
        else:
            assert f"tensorfold.ops.{info.name}" in MODULES, info.name


def test_no_section_names_a_module_that_does_not_exist() -> None:
    for module in sections():
        if module != "tensorfold.ops":
            importlib.import_module(module)


def test_the_name_check_can_fail() -> None:
    assert mentioned("Checkpoint.load", "`Checkpoint.load(name)`")
    assert mentioned("load", "`load(name)`") and not mentioned("load", "`Checkpoint.load`")
    assert not mentioned("load", "loads `load_many`")
    assert "Checkpoint.path" in public_names("tensorfold.family.checkpoint")
    assert "ForwardPass.write_index" in public_names("tensorfold.family.forward_pass")


def _submodule(module: str, name: str) -> str | None:
    """`module.name` when that is a module (imported as one), else None."""
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return None
    return f"{module}.{name}"


def imported_names(code: str) -> set[tuple[str, str]]:
    """(module, name) for every `from tensorfold... import name` in `code`, and for a module so
    imported (`from tensorfold.ops import rope`), (that module, attr) for each `rope.attr`."""
    tree = ast.parse(code)
    found: set[tuple[str, str]] = set()
    modules: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tensorfold":
            for alias in node.names:
                sub = _submodule(node.module, alias.name)
                if sub is None:
                    found.add((node.module, alias.name))
                else:
                    modules[alias.asname or alias.name] = sub
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in modules:
                found.add((modules[node.value.id], node.attr))
    return found


def test_every_name_the_guide_imports_is_in_its_modules_section() -> None:
    text = GUIDE_MD.read_text()
    code = [b for p, b in file_blocks(text).items() if p.endswith(".py")] + check_blocks(text)
    wanted = set().union(*(imported_names(c) for c in code))
    assert ("tensorfold.engine.runner", "open_stream") in wanted
    assert ("tensorfold.ops.rope", "cos_sin") in wanted  # through `from tensorfold.ops import rope`
    found = sections()
    missing = sorted(
        f"{module}: {name}"
        for module, name in wanted
        if module not in found or not mentioned(name, found[module])
    )
    assert not missing, f"docs/reference.md does not list, in the module's section: {missing}"
