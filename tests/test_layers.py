"""The rooms of `tensorfold` (docs/architecture.md, "Rooms"): no module imports a module of a
room above its own, and no modules import each other round in a circle.

Every import counts, at module level or inside a function, except those under
`if TYPE_CHECKING:` (they name types for the checker and load nothing)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# Lowest first. "tensorfold" is the package's own top level: __init__ and the public faces
# (llm.py, testing.py, tool_testing.py, demo_train.py).
ROOMS = ("config", "family", "ops", "memory", "adapters", "engine", "server", "tensorfold", "cli")


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of core/ (any depth) and adapters/."""
    out = {}
    for base, prefix in (("core", ["tensorfold"]), ("adapters", ["tensorfold", "adapters"])):
        for path in sorted((ROOT / base).rglob("*.py")):
            parts = prefix + list(path.relative_to(ROOT / base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = modules()


def room(module: str) -> str:
    """A module's room: the package under tensorfold it is in, or "tensorfold" for the top
    level."""
    parts = module.split(".")
    if len(parts) == 1 or (len(parts) == 2 and (ROOT / "core" / f"{parts[1]}.py").exists()):
        return "tensorfold"
    return parts[1]


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every import statement, at any depth, outside `if TYPE_CHECKING:` blocks."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for sub in node.orelse:
                yield from _imports(sub)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _imports(node)


def imported(module: str, path: Path) -> set[str]:
    """The modules of MODULES that `module` imports. `from package import name` counts as the
    submodule when `name` is one, else as the package (its __init__)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [
                f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source
                for a in node.names
            ]
        out |= {t for t in targets if t in MODULES and t != module}
    return out


GRAPH = {module: imported(module, path) for module, path in MODULES.items()}


def test_every_module_is_in_a_room() -> None:
    assert "tensorfold.engine.lanes" in GRAPH and "tensorfold.adapters.paged_kv" in GRAPH
    strays = sorted(m for m in MODULES if room(m) not in ROOMS)
    assert not strays, f"modules in no room of {ROOMS}: {strays}"


def test_no_module_imports_a_room_above_its_own() -> None:
    upward = [
        f"{m} ({room(m)}) imports {t} ({room(t)})"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if ROOMS.index(room(t)) > ROOMS.index(room(m))
    ]
    assert not upward, "\n".join(upward)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles: one per strongly connected component of more than one module
    (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    found = cycles(GRAPH)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "graph, circles",
    [
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
        ({"a": {"b"}, "b": set(), "c": {"b"}}, []),
        ({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}, [["a", "b"], ["c", "d"]]),
    ],
)
def test_the_circle_check_can_fail(graph: dict[str, set[str]], circles: list[list[str]]) -> None:
    assert sorted(cycles(graph)) == circles


def test_the_import_parser_sees_function_level_imports_and_skips_type_checking() -> None:
    # tensor_parallel's follower imports start inside a function; start names Served's types
    assert "tensorfold.engine.tensor_parallel" in GRAPH["tensorfold.engine.tp_follower"]
    assert "tensorfold.engine.start" not in GRAPH["tensorfold.server.app"]  # TYPE_CHECKING
    assert "tensorfold.engine.lanes" in GRAPH["tensorfold.testing"]  # from .engine import lanes
