"""The KV dtype (TF_KV_DTYPE, --kv-dtype): the dtype paged rows are stored in.

"auto" keeps every row in the family's declared dtype (the model's). "fp8" stores each row a
family marks `RowSpec.fp8` in float8 e4m3 (torch.float8_e4m3fn), with a float32 scale beside it
for every row and every index but the last: a K/V row [Hkv, D] gets scales [Hkv, 1], an MLA
latent row [r] a scale [1]. The scale is the row's amax over that last dim / 448 (e4m3's
largest value), so the stored bits of a row depend on that row alone, and every gate holds
within fp8. A per-page scale taken from the rows one write brings would depend on how passes
cut the page (a prompt pass writes many rows at once, a decode round one, a resume starts
mid-page), so a resumed stream or a window could store other bits than a fresh one; taken from
the page's first row alone it would be exact but clip the later rows. A per-tensor scale fixed
up front would be exact too, but clips or wastes range on rows it was not chosen for.

The scales are one more paged buffer a row (`NAME.scale`), so the pool's page copies, poison,
the host tier and the plan's byte counts carry them with no code of their own. Nothing here
imports torch (the plan uses it before a family loads); tensorfold.ops.kv_quant quantizes.
"""

from __future__ import annotations

from dataclasses import replace

from ..config.settings import SettingsError
from ..family import RowSpec, StateLayout, StateSpec

KV_DTYPES = ("auto", "fp8")
FP8 = "float8_e4m3fn"
SCALE = ".scale"  # suffix of a quantized row's scale buffer


class KVDtypeRefused(SettingsError):
    """--kv-dtype asks for something the family cannot store; the message says what (refused
    before the weights load where the family declares its shape)."""


def scale_spec(spec: RowSpec) -> RowSpec:
    """The scale buffer beside an fp8 row: one float32 a row per index but the last."""
    return RowSpec(spec.name + SCALE, (*spec.shape[:-1], 1), "float32", spec.window)


def scale_state(spec: StateSpec) -> StateSpec:
    """The scales beside fp8 fixed state (a sliding ring [W-1, Hkv, D]: [W-1, Hkv, 1])."""
    return StateSpec(spec.name + SCALE, (*spec.shape[:-1], 1), "float32")


def kv_layout(layout: StateLayout, kv_dtype: str, family: str = "the family") -> StateLayout:
    """The layout as the pool and the slots store it under `kv_dtype`: under "fp8" each RowSpec
    and StateSpec marked fp8 becomes e4m3 and gets its scales beside it; the others are
    unchanged."""
    if kv_dtype not in KV_DTYPES:
        raise KVDtypeRefused(f"--kv-dtype {kv_dtype}: accepted values are {', '.join(KV_DTYPES)}")
    if kv_dtype == "auto":
        return layout
    specs: tuple[RowSpec | StateSpec, ...] = (*layout.paged, *layout.fixed)
    if not any(spec.fp8 for spec in specs):
        raise KVDtypeRefused(
            f"--kv-dtype fp8: {family} stores none of its KV rows in fp8; "
            "drop --kv-dtype (or TF_KV_DTYPE)"
        )
    paged: list[RowSpec] = []
    for spec in layout.paged:
        if spec.fp8 and spec.dtype != FP8:
            paged += [replace(spec, dtype=FP8), scale_spec(spec)]
        else:
            paged.append(spec)
    fixed: list[StateSpec] = []
    for state in layout.fixed:
        if state.fp8 and state.dtype != FP8:
            fixed += [replace(state, dtype=FP8), scale_state(state)]
        else:
            fixed.append(state)
    return replace(layout, paged=tuple(paged), fixed=tuple(fixed))


def kv_label(layout: StateLayout) -> str:
    """How the stored layout keeps its paged rows, for the plan line: "float32",
    "fp8 e4m3 + scales", or "fp8 e4m3 + scales, 6 of 12 buffers bfloat16"."""
    rows = [s for s in layout.paged if not s.name.endswith(SCALE)]
    if not rows:
        return "no paged rows"
    quantized = [s for s in rows if s.dtype == FP8]
    others = sorted({s.dtype for s in rows if s.dtype != FP8})
    if not quantized:
        return "/".join(others)
    label = "fp8 e4m3 + scales"
    if others:
        label += f", {len(rows) - len(quantized)} of {len(rows)} buffers {'/'.join(others)}"
    return label
