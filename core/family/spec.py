"""What a family declares to the core: its registration record and its state layout.

Nothing here imports torch: plugins build these at import time, before a family is chosen.
docs/plugins.md builds a family from these; docs/reference.md describes every field.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable

DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float64": 8,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
}


@dataclass(frozen=True)
class RowSpec:
    """Per-token rows that one paged layer keeps in pool pages (K, V, an MLA latent...).

    `shape` is one row's shape, e.g. (kv_heads, head_dim). `window`: a query at t reads only
    rows t - window < j <= t of this buffer (sliding-window layers), so older rows may leave the
    pool; None reads every row. `fp8`: under TF_KV_DTYPE=fp8 the row is stored in float8 e4m3
    with a scale beside it (tensorfold.memory.kv_dtype); set it only where the family's read path
    dequantizes (PagedRows.scales), the rest stay in `dtype`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    window: int | None = None
    fp8: bool = False

    @property
    def row_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class StateSpec:
    """Per-stream fixed state that is not paged (conv tails, recurrent states, sliding rows).
    `fp8`: under TF_KV_DTYPE=fp8 stored in float8 e4m3 with a scale beside each vector of the
    last dim, as RowSpec.fp8 (sliding K/V rings); set it only where the family quantizes its
    writes and dequantizes its reads (tensorfold.ops.kv_quant). `arena_taps`: a uniform verify
    pass taps this state whole, by row, in its runner's shared tap arena (ForwardPass.tap_space);
    the serving plan reserves room for TAP_ROWS of it (states tapped otherwise, such as rows of a
    ring, take their room in each graph's own memory)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    fp8: bool = False
    arena_taps: bool = False

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

    @property
    def arena_tap_bytes(self) -> int:
        """A row's taps in a verify graph's tap arena: the fixed states marked arena_taps."""
        return sum(s.nbytes for s in self.fixed if s.arena_taps)


def resolve(ref: str) -> Callable[..., Any]:
    """Import "package.module:attr" lazily (the only place families' heavy code is imported)."""
    module, _, attr = ref.partition(":")
    if not module or not attr:
        raise ValueError(f"expected 'module:attribute', got {ref!r}")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know before any weight loads. media_bytes: the device
    bytes a media tower's run on the largest piece its processor produces takes at once (its
    activations; its weights are the checkpoint's, counted with the others), which the plan
    sets aside with the activation reserve; 0 without a tower."""

    layout: StateLayout
    max_positions: int
    media_bytes: int = 0


@dataclass(frozen=True)
class FamilySpec:
    """A family as a plugin registers it. `load` and `build_demo` are "module:function" strings,
    imported only when the family is chosen.

    load(checkpoint: tensorfold.family.checkpoint.Checkpoint, device: str, dtype: str) -> FamilyModel
    build_demo(cache_dir: pathlib.Path) -> pathlib.Path  (a checkpoint folder, built if missing)
    shape(config: dict, dtype: str) -> ModelShape  (from config.json alone, so the memory plan
    can refuse before any weight loads; empty: the plan waits for the loaded model)
    dummy: "module:function(config: dict, device: str, dtype: str) -> FamilyModel" with random
    weights from a fixed seed (TF_LOAD_FORMAT=dummy); empty: the family has none. Under
    --quantization fp8 it is called with quantization="fp8" (refused if it has no such
    parameter).
    serves: the checkpoints the family opens, by config.json's `model_type` values and
    `architectures` class names (e.g. ("llama", "LlamaForCausalLM")): with `--model` and no
    family named, the family that serves the folder's config is chosen.
    demo_rank: when several families are installed and none is named (--family, TF_FAMILY),
    nor served by a --model folder's config, the one with a demo (`build_demo` set) and the
    lowest demo_rank is chosen, then by name.
    fp8_linears: a regular expression over on-disk tensor names: the linears (attention, dense
    FFNs, experts, MTP / draft layers) that `--quantization fp8` quantizes at load and the
    memory plan counts in fp8; each is read with `TensorReader.linear` (or `.experts`), so it
    may come as an `Fp8Weight`. A weight it does not name is never quantized (an FP8
    checkpoint's copy of one is dequantized as it loads). Empty: none (docs/fp8.md).
    hooks: "module:attr" of an object holding the family's per-family hook implementations
    (share_pool, share_attach, snap_keep, snap_restore, shard_plan, tool_call_format);
    registered on the chosen family's own plugin manager only. Empty: the core adapters'
    defaults.

    Under tensor parallel (`--tp N`) `load` and `dummy` run on every rank: `checkpoint.load`
    returns the rank's slice of each tensor as the family's `shard_plan` cuts it,
    `checkpoint.shard` (and `tensorfold.ops.parallel.current()`) say which rank this is.
    """

    name: str
    load: str
    build_demo: str
    shape: str = ""
    description: str = ""
    hooks: str = ""
    dummy: str = ""
    serves: tuple[str, ...] = ()
    demo_rank: int = 100
    fp8_linears: str = ""
    distribution: str = field(default="", compare=False)
    version: str = field(default="", compare=False)

    def serves_config(self, config: dict[str, Any]) -> bool:
        """Whether the family serves a checkpoint of this config.json: its `model_type` or one
        of its `architectures` is in `serves`."""
        archs = config.get("architectures")
        names = [config.get("model_type"), *(archs if isinstance(archs, list) else [])]
        return any(isinstance(n, str) and n in self.serves for n in names)


# -- tensor parallel: how a family's weights and state split across ranks ----------------------


class ShardRefused(Exception):
    """The model cannot be cut for this many tensor-parallel ranks; the message says why."""


def block(parts: int, rank: int, world: int) -> range:
    """The units (heads, experts, channels) of `parts` that rank `rank` of `world` holds:
    [r*parts/w, (r+1)*parts/w) when world divides parts; unit r*parts//w alone when parts
    divides world (fewer units than ranks: each unit is replicated on world/parts ranks)."""
    if parts % world == 0:
        return range(rank * parts // world, (rank + 1) * parts // world)
    if world % parts == 0:
        unit = rank * parts // world
        return range(unit, unit + 1)
    raise ShardRefused(f"{parts} units cannot be cut evenly across {world} ranks")


@dataclass(frozen=True)
class Split:
    """How one on-disk tensor is cut across tensor-parallel ranks.

    dim: the dimension cut (column-parallel: 0 of a [out, in] weight; row-parallel: 1); None
        keeps the tensor whole on every rank (replicated), or on its expert's rank (`experts`).
    parts: how many units the dimension holds (heads, so a rank takes whole heads; 0: its size,
        single channels). Fewer units than ranks (KV heads): each rank takes the unit its block
        of the other heads reads (see `block`).
    groups: the dimension is `groups` equal sections laid end to end (B, C and x of a fused
        in-projection; gate and up), each cut alike; a rank's pieces stay in section order.
    experts: the tensor is one expert's, numbered by the `expert` group of its pattern; rank r
        loads experts `block(experts, r, world)` and no other.
    """

    dim: int | None = None
    parts: int = 0
    groups: int = 1
    experts: int = 0

    def pieces(self, size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """The [start, stop) ranges along `dim` (of length `size`) that rank `rank` reads."""
        if size % self.groups:
            raise ShardRefused(f"{size} rows are not {self.groups} equal sections")
        section = size // self.groups
        parts = self.parts or section
        if section % parts:
            raise ShardRefused(f"{section} rows are not {parts} equal units")
        unit = section // parts
        mine = block(parts, rank, world)
        return [
            (g * section + mine.start * unit, g * section + mine.stop * unit)
            for g in range(self.groups)
        ]


REPLICATED = Split()
COLUMN = Split(dim=0)  # the output rows of a [out, in] weight (q/k/v, gate/up, in_proj)
ROW = Split(dim=1)  # the input columns of a [out, in] weight (o, down, out_proj)


@dataclass(frozen=True)
class ShardPlan:
    """A family's answer for `world` tensor-parallel ranks (the `shard_plan` hook).

    splits: (pattern, Split) pairs; a tensor takes the first pattern that matches its whole
        on-disk name (re.fullmatch); names no pattern matches are replicated. A Split with
        `experts` needs a pattern with a `(?P<expert>...)` group.
    layout: one rank's state layout (its heads' K/V rows, its channels' conv tails). Every rank
        has the same layout: the memory plan runs on it per rank.
    """

    splits: tuple[tuple[str, Split], ...]
    layout: StateLayout

    def split_of(self, name: str) -> tuple[Split, int | None]:
        """The Split for an on-disk tensor name, and its expert number (None: not an expert's)."""
        for pattern, split in self.splits:
            found = re.fullmatch(pattern, name)
            if found:
                expert = found.groupdict().get("expert")
                return split, None if expert is None else int(expert)
        return REPLICATED, None


@dataclass(frozen=True)
class Shard:
    """This process's place in tensor parallel: rank `rank` of `world` (1: no tensor parallel),
    cutting weights by `plan` (None at world 1)."""

    rank: int = 0
    world: int = 1
    plan: ShardPlan | None = None

    def experts(self, n: int) -> range:
        """The experts of `n` this rank holds (all of them at world 1); each expert lives on one
        rank only, so its partial sums are counted once."""
        if n % self.world:
            raise ShardRefused(f"{n} experts cannot be shared evenly by {self.world} ranks")
        return range(self.rank * n // self.world, (self.rank + 1) * n // self.world)

    def heads(self, n: int) -> range:
        """The heads (or other units) of `n` this rank holds."""
        return block(n, self.rank, self.world) if self.world > 1 else range(n)
