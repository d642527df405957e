"""What a family declares to the core: its registration record and its state layout.

Nothing here imports torch: plugins build these at import time, before a family is chosen.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int32": 4, "int64": 8}


@dataclass(frozen=True)
class RowSpec:
    """Per-token rows that one paged layer keeps in pool pages (K, V, an MLA latent...).

    `shape` is one row's shape, e.g. (kv_heads, head_dim). `window`: a query at t reads only
    rows t - window < j <= t of this buffer (sliding-window layers), so older rows may leave the
    pool; None reads every row.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    window: int | None = None

    @property
    def row_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateSpec:
    """Per-stream fixed state that is not paged (conv tails, recurrent states, sliding rows)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateLayout:
    """How a family's per-stream memory splits into paged rows and fixed state.

    mark_rows: usable resume marks are multiples of this many rows (1 = anywhere).
    """

    paged: tuple[RowSpec, ...] = ()
    fixed: tuple[StateSpec, ...] = ()
    mark_rows: int = 1

    @property
    def row_bytes(self) -> int:
        return sum(r.row_bytes for r in self.paged)

    def page_bytes(self, page_rows: int) -> int:
        return self.row_bytes * page_rows

    @property
    def fixed_bytes(self) -> int:
        return sum(s.nbytes for s in self.fixed)


def resolve(ref: str) -> Callable[..., Any]:
    """Import "package.module:attr" lazily (the only place families' heavy code is imported)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"expected 'module:attribute', got {ref!r}")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know before any weight loads."""

    layout: StateLayout
    max_positions: int


@dataclass(frozen=True)
class FamilySpec:
    """A family as a plugin registers it. `load` and `build_demo` are "module:function" strings,
    imported only when the family is chosen.

    load(checkpoint: tensorfold.checkpoint.Checkpoint, device: str, dtype: str) -> FamilyModel
    build_demo(cache_dir: pathlib.Path) -> pathlib.Path  (a checkpoint folder, built if missing)
    shape(config: dict, dtype: str) -> ModelShape  (from config.json alone, so the memory plan
    can refuse before any weight loads; empty: the plan waits for the loaded model)
    dummy: "module:function(config: dict, device: str, dtype: str) -> FamilyModel" with random
    weights from a fixed seed (TF_LOAD_FORMAT=dummy); empty: the family has none.
    hooks: "module:attr" of an object holding the family's per-family hook implementations
    (share_pool, share_attach, snap_keep, snap_restore); registered on the chosen family's own
    plugin manager only. Empty: the core adapters' defaults.
    """

    name: str
    load: str
    build_demo: str
    shape: str = ""
    description: str = ""
    hooks: str = ""
    dummy: str = ""
    distribution: str = field(default="", compare=False)
    version: str = field(default="", compare=False)
