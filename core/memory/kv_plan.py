"""The memory plan: how the room (device bytes for KV state) splits into stream pages, fixed
state, the prompt cache and what is left. Pure arithmetic, bytes everywhere; kv_pool builds the
pages this plan counts.

Windows mode: every lane owns a window's pages and its fixed state; the cache gets what is left,
up to its budget.

Pages mode, with wp = ceil(window / page_rows), W = wp * page_bytes, F = fixed_bytes, L lanes:

    k     = clamp((room - L*F) // W, 1, L)    whole windows the room holds, 1..L
    held  = max(k * wp, wp + L - 1)           k windows, or a window and a page each other lane
    need  = held * page_bytes + L * F         refused past the room
    fund  = min(cache_budget, room - need)    prompt cache, the snapshot arena first
    pages = min(held + (room - need - fund) // page_bytes, L * wp)
                                              the rest is pages, up to a window every lane

So the windows are set aside before the cache, and pages never hold fewer rows than windows in
the same room: if L windows fit, k = L and held = L * wp. Worked example, 1M window at
--parallel 8, page_rows 512 (wp 2048), 5.5 MiB pages, 180 MiB fixed, room 13.44 GiB: k = 1,
held = max(2048, 2048 + 7) = 2055 pages (11.04 GiB), fixed 8 * 180 MiB = 1.41 GiB, the cache
gets the last 1 GiB. Windows would need 8 * 11.18 GiB = 89.41 GiB and are refused.

The prompt store's kept states (`states`): a number (TF_KV_SHARE=n), 0 with no store, or
"auto" (TF_KV_SHARE unset): sized from what the plan funds, each state a snapshot and
AUTO_STATE_PAGES pages, and never fewer than MIN_STATES_A_LANE a lane (the arena then takes
what the fund allows, and the start warns).

TF_KV_PAGES: "off" and "0" plan windows; "on" and "auto" plan pages whenever the family has
paged rows (page_bytes > 0); pages are never worse than windows, so auto always takes them. A
family with no paged rows has nothing to page and plans windows of fixed state in every mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
PASS_ROWS = 2048
MAX_AUTO_LANES = 64
PAGING_MODES = ("auto", "on", "off", "0")
MIN_STATES_A_LANE = 4  # kept states a lane the store is sized for at least
AUTO_STATE_PAGES = 2  # pages an automatically sized state is funded beside its snapshot
MAX_AUTO_STATES = 4096

Lanes = int | Literal["auto"]


def fmt_bytes(n: int | float) -> str:
    """A size as people read it: "12.80 GiB", "180 MiB", "4.00 KiB", "12 B"."""
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            v = n / unit
            if name == "GiB":
                return f"{v:.2f} GiB"
            return f"{v:.{0 if v >= 100 else 1 if v >= 10 else 2}f} {name}"
    return f"{int(n)} B"


class PlanRefused(Exception):
    """The streams asked for do not fit the room; the message names need, have and what fits."""

    def __init__(self, message: str, *, need: int, have: int) -> None:
        super().__init__(message)
        self.need = need
        self.have = have


@dataclass(frozen=True)
class Plan:
    mode: Literal["windows", "pages"]
    lanes: int
    pages: int  # the pool's pages, all lanes together
    page_rows: int
    page_bytes: int
    fixed_bytes: int  # a lane's fixed state
    window: int
    cache_bytes: int  # prompt cache funded, not counting the snapshot arena
    left_bytes: int  # room not used
    windows_held: int  # whole windows' rows the pages are
    snapshot_bytes: int = 0  # snapshot arena, funded inside the prompt-cache budget
    pass_rows: int = PASS_ROWS
    ranks: int = 1  # tensor-parallel ranks: bytes are one rank's (each holds its shard's state)
    states: int = 0  # kept states the prompt store may hold (0: not counted by the plan)
    store_on: bool = True  # False: the prompt store is off (TF_KV_SHARE=0)
    kv_label: str = ""  # how pages store their rows (kv_dtype.kv_label), for the start line
    weight_bytes: int = 0  # the weights the plan left room for (0: not counted before loading)
    weight_label: str = ""  # how they are stored ("fp8 linears"), for the start line

    @property
    def total_rows(self) -> int:
        return self.pages * self.page_rows

    @property
    def pages_bytes(self) -> int:
        return self.pages * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return (
            self.pages_bytes
            + self.lanes * self.fixed_bytes
            + self.cache_bytes
            + self.snapshot_bytes
        )

    def startup_line(self) -> str:
        label = f"kv plan per rank (tp {self.ranks})" if self.ranks > 1 else "kv plan"
        rows = f" rows in {self.kv_label}" if self.kv_label else " rows"
        if self.mode == "pages":
            head = (
                f"{label}: {self.lanes} streams taking {self.pages} pages of {self.page_rows}"
                f"{rows} ({fmt_bytes(self.pages_bytes)}, {self.total_rows:,} rows) as they need"
                f" them (enough for {self.windows_held} at a {self.window}-token window)"
            )
        else:
            each = self.pages_bytes // max(self.lanes, 1)
            head = (
                f"{label}: {self.lanes} streams at once, {fmt_bytes(each)} each at a"
                f" {self.window}-token window: {self.total_rows:,}{rows}"
            )
        snaps = ""
        if self.snapshot_bytes:
            snaps = f" with {fmt_bytes(self.snapshot_bytes)} of snapshots"
        if self.states:
            snaps += f" for {self.states} kept states"
        store = (
            f"prompt cache {fmt_bytes(self.cache_bytes)}{snaps}"
            if self.store_on
            else "prompt store off"
        )
        weights = ""
        if self.weight_bytes:
            how = f" ({self.weight_label})" if self.weight_label else ""
            weights = f"; weights {fmt_bytes(self.weight_bytes)}{how}"
        return (
            f"{head}, {fmt_bytes(self.fixed_bytes)} fixed each, {store},"
            f" {fmt_bytes(self.left_bytes)} left, prompts in passes of up to"
            f" {self.pass_rows} rows{weights}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _need(mode: str, lanes: int, wpages: int, page_bytes: int, fixed: int) -> int:
    """The least bytes `lanes` streams at a window of `wpages` pages take in this mode."""
    pages = lanes * wpages if mode == "windows" else wpages + lanes - 1
    return pages * page_bytes + lanes * fixed


def _refuse(
    mode: str,
    label: str,
    lanes: int,
    room: int,
    page_rows: int,
    page_bytes: int,
    fixed: int,
    window: int,
) -> PlanRefused:
    wp = _ceil_div(window, page_rows)
    need = _need(mode, lanes, wp, page_bytes, fixed)

    def fits(n: int, pages: int) -> bool:
        return _need(mode, n, pages, page_bytes, fixed) <= room

    lo, hi = 0, lanes - 1  # the largest --parallel below the asked one that fits at this window
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid, wp) else (lo, mid - 1)
    ctx = 0  # the largest page_rows * 2**j below the window that fits the asked lanes
    c = page_rows
    while c < window and fits(lanes, _ceil_div(c, page_rows)):
        ctx, c = c, c * 2
    said = [f"--parallel {lo}"] if lo else []
    if ctx:
        said.append(f"--context {ctx} at --parallel {lanes}")
    if said:
        tail = f"{', or '.join(said)}{',' if len(said) > 1 else ''} would fit"
    else:
        tail = f"not even --parallel 1 at a {page_rows}-token context would fit"
    msg = (
        f"--parallel {label} needs {fmt_bytes(need)} for its streams at a {window}-token"
        f" window, and the memory budget leaves {fmt_bytes(room)}; {tail}"
    )
    return PlanRefused(msg, need=need, have=room)


def plan(
    *,
    room: int,
    page_rows: int,
    page_bytes: int,
    fixed_bytes: int,
    window: int,
    lanes: Lanes,
    cache_budget: int,
    paging: str,
    snapshot_bytes: int = 0,
    states: int | Literal["auto"] = 0,
    store: bool = True,
) -> Plan:
    """Plan the room (see the module docstring). `lanes="auto"` takes as many lanes as whole
    windows fit (at least 1, at most MAX_AUTO_LANES), in either mode. Raises PlanRefused when
    the streams do not fit, ValueError on a bad argument. The snapshot arena comes first out of
    the prompt-cache funding, so it may be smaller than asked (Plan.snapshot_bytes says).
    `states`: the store's kept states, a number (its arena is `snapshot_bytes`), 0 when the
    plan does not count them, or "auto": sized from the funding (see the module docstring), the
    arena then being states * fixed_bytes, and `snapshot_bytes` ignored (no state funded: the
    store is off). `store=False`: the
    prompt store is off (nothing funded)."""
    if paging not in PAGING_MODES:
        raise ValueError(f"TF_KV_PAGES={paging!r}: expected one of {', '.join(PAGING_MODES)}")
    if page_rows < 1 or window < 1:
        raise ValueError(f"page_rows and window must be >= 1, got {page_rows} and {window}")
    if min(room, page_bytes, fixed_bytes, cache_budget, snapshot_bytes) < 0:
        raise ValueError("room, page_bytes, fixed_bytes, cache_budget, snapshot_bytes: not >= 0")
    if lanes != "auto" and (not isinstance(lanes, int) or lanes < 1):
        raise ValueError(f"--parallel must be a positive number or auto, got {lanes!r}")
    mode: Literal["windows", "pages"] = (
        "pages" if paging in ("auto", "on") and page_bytes > 0 else "windows"
    )
    wp = _ceil_div(window, page_rows)
    W, F = wp * page_bytes, fixed_bytes
    if lanes == "auto":
        fit = MAX_AUTO_LANES if W + F == 0 else room // (W + F)
        n, label = max(1, min(fit, MAX_AUTO_LANES)), "auto"
    else:
        n, label = lanes, str(lanes)
    if mode == "windows":
        held = n * wp
    else:
        k = max(1, min(n, (room - n * F) // W))
        held = max(k * wp, wp + n - 1)
    need = held * page_bytes + n * F
    if need > room:
        raise _refuse(mode, label, n, room, page_rows, page_bytes, F, window)
    fund = min(cache_budget, room - need) if store else 0
    if states == "auto":  # whole snapshots, within the fund
        kept = auto_states(fund, fixed_bytes=F, page_bytes=page_bytes, lanes=n)
        snapshot_bytes = kept * F
        if kept == 0:  # nothing left to fund it (or a budget of 0): off, and said so
            store, fund = False, 0
    else:
        kept = states
    snap = min(snapshot_bytes, fund)
    if F and kept:
        kept = min(kept, snap // F)  # what the arena holds
    pages = held
    if mode == "pages":
        pages = min(held + (room - need - fund) // page_bytes, n * wp)
    left = room - pages * page_bytes - n * F - fund
    return Plan(
        mode=mode,
        lanes=n,
        pages=pages,
        page_rows=page_rows,
        page_bytes=page_bytes,
        fixed_bytes=F,
        window=window,
        cache_bytes=fund - snap,
        left_bytes=left,
        windows_held=pages // wp,
        snapshot_bytes=snap,
        states=kept if store else 0,
        store_on=store,
    )


def auto_states(fund: int, *, fixed_bytes: int, page_bytes: int, lanes: int) -> int:
    """Kept states for a store funded `fund` bytes: each state its snapshot and
    AUTO_STATE_PAGES pages, at least MIN_STATES_A_LANE a lane where the fund holds their
    snapshots (else as many snapshots as it holds), at most MAX_AUTO_STATES; 0 with nothing
    funded."""
    if fund <= 0:
        return 0
    each = fixed_bytes + AUTO_STATE_PAGES * page_bytes
    fit = MAX_AUTO_STATES if each == 0 else fund // each
    floor = MIN_STATES_A_LANE * lanes  # snapshots first: pages may then be shared or fewer
    if fixed_bytes:
        floor = min(floor, fund // fixed_bytes)
    return min(MAX_AUTO_STATES, max(floor, fit))


def memory_budget(
    *,
    device_free: int | None,
    weights: int,
    reserve: int,
    activations: int,
    limit_gib: float | None,
) -> int:
    """The room for the plan, in bytes (never negative: an empty room is refused by plan).

    device_free: free CUDA memory now (torch.cuda.mem_get_info), None on the CPU. Weights
    already loaded are already out of it, so `weights` is what is still to load (0 after
    loading; the checkpoint's bytes when planning before the load, as the start-up does).
    limit_gib (TF_MEMORY_LIMIT_GIB) stands in for free memory on the CPU, where it is required,
    and on CUDA caps the device's number when lower, to test pressure. The room is that free
    memory less the weights still to load, the reserve and the activations.
    """
    if limit_gib is not None and limit_gib < 0:
        raise ValueError(f"TF_MEMORY_LIMIT_GIB must be >= 0, got {limit_gib}")
    if device_free is None:
        if limit_gib is None:
            raise ValueError(
                "on the CPU the memory budget comes from TF_MEMORY_LIMIT_GIB: set it"
                " to the GiB the engine may use (weights included)"
            )
        free = int(limit_gib * GiB)
    else:
        free = device_free if limit_gib is None else min(device_free, int(limit_gib * GiB))
    return max(0, free - weights - reserve - activations)
