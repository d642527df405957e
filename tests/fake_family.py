"""A fake family plugin for the core's plugin tests: no torch, no weights.

`FamiliesPlugin("a", "b")` registers families a and b; family "x" names `fake_family:hooks_x`
as its per-family hooks object, and `HOOKS` maps names to those objects for the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorfold
from tensorfold.family import FamilySpec
from tensorfold.family.profiles import ProfileRow


def spec(name: str) -> FamilySpec:
    return FamilySpec(
        name=name,
        load="fake_family:load",
        build_demo="fake_family:build_demo",
        description=f"fake family {name}",
        hooks=f"fake_family:hooks_{name}",
    )


class FamiliesPlugin:
    def __init__(self, *names: str, rows: tuple[ProfileRow, ...] = ()) -> None:
        self.names = names
        self.rows = rows

    @tensorfold.hookimpl
    def register_families(self, register: Callable[[FamilySpec], None]) -> None:
        for name in self.names:
            register(spec(name))

    @tensorfold.hookimpl
    def profile_rows(self, register: Callable[[ProfileRow], None]) -> None:
        for row in self.rows:
            register(row)


class FamilyHooks:
    """Per-family hooks that record their calls and answer with their family's name."""

    def __init__(self, name: str, restore: bool | None = True) -> None:
        self.name = name
        self.restore = restore
        self.calls: list[str] = []

    @tensorfold.hookimpl
    def share_pool(self, layout: Any, num_pages: int) -> str:
        self.calls.append("share_pool")
        return f"{self.name}:{num_pages}"

    @tensorfold.hookimpl
    def snap_restore(self, snapshot: Any, slot: int) -> bool | None:
        self.calls.append("snap_restore")
        return self.restore


class DefaultHooks:
    """Stands in for the core adapters: answers every per-family hook it implements."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @tensorfold.hookimpl
    def share_pool(self, layout: Any, num_pages: int, page_rows: int, device: str) -> str:
        self.calls.append("share_pool")
        return "default"

    @tensorfold.hookimpl
    def snap_restore(self, snapshot: Any, arena: Any, slots: Any, slot: int) -> bool:
        self.calls.append("snap_restore")
        return True


hooks_a = FamilyHooks("a", restore=None)  # defers snap_restore to the defaults
hooks_b = FamilyHooks("b")
HOOKS = {"a": hooks_a, "b": hooks_b}
