"""The kernel switches still undecided, in one place: each picks between two ways of computing
the same thing on the GPU, kept only where a GPU run has not decided between them yet (or each
way wins somewhere). Every other A/B of the kernels was decided and its losing way deleted; the
record of each decision is in docs/performance.md's decisions, under the switch's name.

A kernel reads a switch's current value with `SWITCH.on()`; tests and benchmarks set it with
`switched(SWITCH, value)` (a context manager) or `set_value(name, value)`
(`bench/experiments/with_switch.py tensorfold.ops.switches.NAME=False ...`). Every value of
every switch is run by a test on the CPU under the interpreter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """One undecided A/B: its name, its default, what each value does, where its decision is
    recorded and why both values stay."""

    name: str
    default: bool
    when_on: str
    when_off: str
    record: str
    why: str

    def on(self) -> bool:
        """The switch's current value."""
        return _values[self.name]


FP32_CHAIN_SUMS = Switch(
    name="FP32_CHAIN_SUMS",
    default=True,
    when_on="an fp32 router on a columns-major gate (triton_route._router_chain_kernel) adds "
    "its chunks in its own launch, the last program of each expert block to arrive",
    when_off="the chain's chunks are added by the route kernel (64 partial rows read)",
    record='docs/performance.md, "FP32_CHAIN_SUMS"',
    why="no family stores its gate columns-major yet; the chain's own sums have not been timed "
    "on a GPU (bench/experiments/glm_one_program.py's route ways hold both)",
)
OWN_RECURRENT = Switch(
    name="OWN_RECURRENT",
    default=True,
    when_on="the KDA delta rule's recurrent rows in tensorfold_glm.triton_kda.recurrent: one "
    "launch a layer under dependent launch, the rows in place",
    when_off="fla-core's fused_recurrent_kda on packed copies of the rows (on the CPU the "
    "packed torch stand-in), after beta's sigmoid and the fresh slots' zeroing",
    record='docs/performance.md, "OWN_RECURRENT"',
    why="its bits passed the GPU suite (one H100, 567e0c4) but its speed against fla-core's "
    "kernel has not been timed",
)
KDA_TAIL_IN_PLACE = Switch(
    name="KDA_TAIL_IN_PLACE",
    default=True,
    when_on="a KDA decode pass's conv tails moved on by the conv's own launch "
    "(tensorfold_glm.triton_kda.conv_silu)",
    when_off="the tails moved on by tail_kernel's launch after the conv's",
    record='docs/performance.md, "KDA_TAIL_IN_PLACE"',
    why="its bits passed the GPU suite (one H100, 567e0c4) but it has not been timed; lfm2's "
    "conv has the same fold, measured and kept",
)
FUSED_EXPAND_COLLAPSE = Switch(
    name="FUSED_EXPAND_COLLAPSE",
    default=True,
    when_on="a pass of up to FUSED_MAX_ROWS rows takes mHC's expand and the next collapse in "
    "one launch (tensorfold_glm.triton_mhc.expand_collapse_norm)",
    when_off="expand's launch, then collapse_norm's two",
    record='docs/performance.md, "FUSED_EXPAND_COLLAPSE"',
    why="its bits passed the GPU suite (one H100, 567e0c4) but it has not been timed",
)
GATE_MAPS_IN_ONE_LAUNCH = Switch(
    name="GATE_MAPS_IN_ONE_LAUNCH",
    default=True,
    when_on="glm5_next's KDA f_b and g_b products in one launch (linear_groups on the joint "
    "weight fg_b: its tiles and K split, other bits than f_b's own)",
    when_off="f_b and g_b as two linears",
    record='docs/performance.md, "GATE_MAPS_IN_ONE_LAUNCH"',
    why="on since d5649f4 without a GPU timing (the device was lost before it ran); the two "
    "ways give other bits, so a change of default changes glm5_next's tokens",
)

SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        FP32_CHAIN_SUMS,
        OWN_RECURRENT,
        KDA_TAIL_IN_PLACE,
        FUSED_EXPAND_COLLAPSE,
        GATE_MAPS_IN_ONE_LAUNCH,
    )
}
_values: dict[str, bool] = {name: s.default for name, s in SWITCHES.items()}


def set_value(name: str, value: bool) -> bool:
    """Set switch `name` to `value` (a bool); returns its value before."""
    if name not in SWITCHES:
        raise KeyError(f"no switch {name!r}; the switches: {', '.join(SWITCHES)}")
    if not isinstance(value, bool):
        raise TypeError(f"switch {name} takes True or False, not {value!r}")
    before, _values[name] = _values[name], value
    return before


@contextmanager
def switched(switch: Switch, value: bool) -> Iterator[None]:
    """`switch` set to `value` inside the block, its value before restored after it."""
    before = set_value(switch.name, value)
    try:
        yield
    finally:
        _values[switch.name] = before
