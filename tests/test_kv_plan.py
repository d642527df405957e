"""kv_plan: the memory plan's arithmetic, spelled out."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorfold.memory.kv_plan import (
    MAX_AUTO_LANES,
    PASS_ROWS,
    GiB,
    MiB,
    Plan,
    PlanRefused,
    fmt_bytes,
    memory_budget,
    plan,
)

ROWS = 512
PAGE = 5 * MiB + MiB // 2  # 5.5 MiB a page of 512 rows (all paged layers together)
FIXED = 180 * MiB
M1 = 1 << 20  # a 1M-token window: 2048 pages, 11 GiB
WP_1M = M1 // ROWS
W_1M = WP_1M * PAGE
K128 = 1 << 17  # a 128k window: 256 pages, 1408 MiB
WP_128K = K128 // ROWS
W_128K = WP_128K * PAGE


def mk(
    room: int,
    lanes: int | str,
    paging: str,
    window: int = M1,
    cache: int = 16 * GiB,
    snapshot: int = 0,
    *,
    rows: int = ROWS,
    page: int = PAGE,
    fixed: int = FIXED,
    states: int | Literal["auto"] = 0,
    store: bool = True,
) -> Plan:
    """The plan of `room` for pages of ROWS rows, PAGE bytes and FIXED bytes a lane unless told."""
    return plan(
        room=room,
        page_rows=rows,
        page_bytes=page,
        fixed_bytes=fixed,
        window=window,
        lanes=lanes,
        cache_budget=cache,
        paging=paging,
        snapshot_bytes=snapshot,
        states=states,
        store=store,
    )


# A room of one 1M window, a page for each other lane and fixed state for 8, plus 1 GiB:
# 11 GiB + 7 * 5.5 MiB + 8 * 180 MiB + 1 GiB = 12 GiB + 1478.5 MiB = 13.44 GiB.
ROOM_1M = W_1M + 7 * PAGE + 8 * FIXED + GiB


def test_1m_window_at_parallel_8_windows_refused() -> None:
    # Windows need 8 * (11 GiB + 180 MiB) = 88 GiB + 1440 MiB = 89.41 GiB.
    # --parallel: room // (11 GiB + 180 MiB) = 13.44 // 11.18 = 1.
    # --context at 8: per lane 13.44 GiB / 8 - 180 MiB = 1.63 GiB = 303 pages = 155,136 rows;
    # the largest 512 * 2**j under that is 131072 (256 pages).
    with pytest.raises(PlanRefused) as e:
        mk(ROOM_1M, 8, "off")
    assert str(e.value) == (
        "--parallel 8 needs 89.41 GiB for its streams at a 1048576-token window, and the memory"
        " budget leaves 13.44 GiB; --parallel 1, or --context 131072 at --parallel 8, would fit"
    )
    assert e.value.need == 8 * (W_1M + FIXED) and e.value.have == ROOM_1M


def test_1m_window_at_parallel_8_pages() -> None:
    p = mk(ROOM_1M, 8, "on")
    # k = (room - 8 * 180 MiB) // 11 GiB = (11 GiB + 38.5 MiB + 1 GiB) // 11 GiB = 1 window;
    # held = max(1 * 2048, 2048 + 7) = 2055 pages: one window and a page for each other lane.
    assert p.mode == "pages" and p.lanes == 8
    assert p.pages == WP_1M + 7 == 2055
    assert p.windows_held == 1
    # The cache gets the 1 GiB left, under its 16 GiB budget; nothing is left over.
    assert p.cache_bytes == GiB and p.left_bytes == 0
    assert p.total_bytes == ROOM_1M == p.pages * PAGE + 8 * FIXED + GiB


def test_rest_is_pages_when_the_cache_is_small() -> None:
    # --prompt-cache-gib 0: the 1 GiB past the held pages becomes 1024 MiB // 5.5 MiB = 186 pages,
    # 1023 MiB; 1 MiB is left.
    p = mk(ROOM_1M, 8, "on", cache=0)
    assert p.pages == 2055 + 186 and p.cache_bytes == 0 and p.left_bytes == MiB
    # Never past a window for every lane: one lane in the same room stops at 2048 pages.
    one = mk(ROOM_1M, 1, "on", cache=0)
    assert one.pages == WP_1M and one.left_bytes == ROOM_1M - W_1M - FIXED


def test_room_of_four_windows_at_parallel_4() -> None:
    # Four 128k windows and fixed state: 4 * (1408 + 180) MiB = 6352 MiB, plus 512 MiB.
    room = 4 * (W_128K + FIXED) + 512 * MiB
    p = mk(room, 4, "auto", window=K128)
    # k = (room - 4 * 180 MiB) // 1408 MiB = (5632 + 512) // 1408 = 4: all four windows' pages
    # are set aside before the 16 GiB cache, which gets only the 512 MiB left after them.
    assert p.mode == "pages" and p.pages == 4 * WP_128K == 1024 and p.windows_held == 4
    assert p.total_rows == 4 * K128
    assert p.cache_bytes == 512 * MiB and p.left_bytes == 0
    w = mk(room, 4, "off", window=K128)
    assert w.mode == "windows" and w.lanes == 4 and w.pages == 1024 and w.windows_held == 4
    assert w.cache_bytes == 512 * MiB and w.left_bytes == 0


def test_parallel_auto() -> None:
    room = 3 * (W_128K + FIXED) + 100 * MiB  # three windows (1588 MiB each) and a bit
    w = mk(room, "auto", "off", window=K128)
    assert (w.mode, w.lanes, w.pages) == ("windows", 3, 3 * WP_128K)
    p = mk(room, "auto", "on", window=K128)  # as many lanes as the windows set aside
    assert (p.mode, p.lanes, p.pages, p.windows_held) == ("pages", 3, 3 * WP_128K, 3)
    # A 512-token window in 100 GiB would take thousands of lanes: capped.
    assert mk(100 * GiB, "auto", "on", window=512).lanes == MAX_AUTO_LANES
    assert mk(100 * GiB, "auto", "off", window=512).lanes == MAX_AUTO_LANES
    # Not one 2M window (4096 pages, 22 GiB + 180 MiB = 22.18 GiB): auto is refused, naming the
    # context one lane fits at: 13.44 GiB - 180 MiB = 13.27 GiB / 5.5 MiB = 2470 pages, so
    # 512 * 2**j = 1048576 (2048 pages).
    with pytest.raises(
        PlanRefused,
        match=r"^--parallel auto needs 22\.18 GiB .* 13\.44 GiB; "
        r"--context 1048576 at --parallel 1 would fit$",
    ):
        mk(ROOM_1M, "auto", "off", window=1 << 21)


def test_paging_modes() -> None:
    room = 4 * (W_128K + FIXED)
    assert mk(room, 4, "off", window=K128).mode == "windows"
    assert mk(room, 4, "0", window=K128).mode == "windows"
    assert mk(room, 4, "on", window=K128).mode == "pages"
    assert mk(room, 4, "auto", window=K128).mode == "pages"
    # No paged rows (a purely recurrent family): nothing to page, windows of fixed state.
    flat = mk(GiB, 4, "auto", window=K128, cache=0, page=0)
    assert flat.mode == "windows" and flat.left_bytes == GiB - 4 * FIXED
    with pytest.raises(ValueError, match="auto, on, off, 0"):
        mk(room, 4, "yes", window=K128)
    with pytest.raises(ValueError, match="--parallel"):
        mk(room, 0, "on", window=K128)


def test_refusals_name_what_exists() -> None:
    # Pages at --parallel 8 need one window, 7 pages and 8 fixed: 11 GiB + 38.5 + 1440 MiB =
    # 12.44 GiB > 12 GiB. --parallel 5: 2048 + 4 pages (11.02 GiB) + 5 * 180 MiB (0.88 GiB) =
    # 11.90 GiB fits; 6 would be 11.03 + 1.05 = 12.08 GiB. --context 524288 at 8: 1024 + 7 pages
    # (5.54 GiB) + 1.41 GiB = 6.95 GiB fits; the next, the 1M window itself, is what was refused.
    with pytest.raises(PlanRefused) as e:
        mk(12 * GiB, 8, "on")
    assert str(e.value).endswith("; --parallel 5, or --context 524288 at --parallel 8, would fit")
    assert "needs 12.44 GiB" in str(e.value)
    # Too small for one page and fixed state: 5.5 MiB + 180 MiB > 100 MiB.
    with pytest.raises(PlanRefused, match="not even --parallel 1 at a 512-token context would fit"):
        mk(100 * MiB, 4, "on")
    # Room for 2 lanes but no smaller context at 4 (a window is one page already).
    with pytest.raises(PlanRefused, match=r"; --parallel 2 would fit$"):
        mk(2 * (PAGE + FIXED), 4, "off", window=ROWS)


def test_snapshot_arena_inside_the_cache_budget() -> None:
    p = mk(ROOM_1M, 8, "on", snapshot=256 * MiB)
    assert p.snapshot_bytes == 256 * MiB and p.cache_bytes == 768 * MiB
    assert p.total_bytes == ROOM_1M
    small = mk(ROOM_1M, 8, "on", snapshot=4 * GiB)  # only 1 GiB to fund: the arena gets it all
    assert small.snapshot_bytes == GiB and small.cache_bytes == 0


def test_startup_line() -> None:
    p = mk(ROOM_1M, 8, "on")
    assert p.startup_line() == (
        "kv plan: 8 streams taking 2055 pages of 512 rows (11.04 GiB, 1,052,160 rows) as they need"
        " them (enough for 1 at a 1048576-token window), 180 MiB fixed each, prompt cache 1.00 GiB,"
        f" 0 B left, prompts in passes of up to {PASS_ROWS} rows"
    )
    room = 4 * (W_128K + FIXED) + 3 * GiB
    w = mk(room, 4, "off", window=K128, cache=2 * GiB, snapshot=64 * MiB)
    assert w.startup_line() == (
        "kv plan: 4 streams at once, 1.38 GiB each at a 131072-token window: 524,288 rows,"
        " 180 MiB fixed each, prompt cache 1.94 GiB with 64.0 MiB of snapshots, 1.00 GiB left,"
        " prompts in passes of up to 2048 rows"
    )


def test_the_store_sized_by_the_plan() -> None:
    # The room's last GiB funds the store: each automatic state is its 180 MiB snapshot and two
    # 5.5 MiB pages (191 MiB), so 1 GiB holds 5, fewer than 4 a lane at --parallel 8: the plan
    # asks 32, and the arena takes what the GiB funds, 5 snapshots (900 MiB).
    p = mk(ROOM_1M, 8, "on", states="auto")
    assert p.states == 5 and p.snapshot_bytes == 5 * FIXED
    assert p.cache_bytes == GiB - 5 * FIXED and p.total_bytes == ROOM_1M
    assert "prompt cache 124 MiB with 900 MiB of snapshots for 5 kept states" in p.startup_line()
    # 20 GiB more room: a second window's pages (11 GiB), and the store funded the rest
    # (10.00 GiB), 53 states of 191 MiB, more than 4 a lane.
    big = mk(ROOM_1M + 20 * GiB, 8, "on", states="auto")
    fund = ROOM_1M + 20 * GiB - 2 * W_1M - 8 * FIXED
    assert big.windows_held == 2 and big.cache_bytes + big.snapshot_bytes == fund
    assert big.states == fund // (FIXED + 2 * PAGE) == 53 and big.snapshot_bytes == 53 * FIXED
    # No fixed state: states cost only their pages.
    flat = mk(ROOM_1M + 20 * GiB, 8, "on", cache=GiB, fixed=0, states="auto")
    assert flat.states == flat.cache_bytes // (2 * PAGE) == 41 and flat.snapshot_bytes == 0
    # At least 4 a lane when the fund allows it.
    few = mk(ROOM_1M + 20 * GiB, 8, "on", cache=100 * MiB, fixed=MiB, states="auto")
    assert few.states == 32 and few.snapshot_bytes == 32 * MiB


def test_the_store_off_says_so() -> None:
    p = mk(ROOM_1M, 8, "on", store=False)
    assert p.cache_bytes == p.snapshot_bytes == p.states == 0 and p.pages == 2055 + GiB // PAGE
    assert ", 180 MiB fixed each, prompt store off, 1.00 MiB left," in p.startup_line()
    # On by default, but a budget of 0 (or no room past the streams) funds no state: off too.
    for room, cache in ((ROOM_1M, 0), (ROOM_1M - GiB, 16 * GiB)):
        unfunded = mk(room, 8, "on", cache=cache, states="auto")
        assert not unfunded.store_on and unfunded.states == 0
        assert "prompt store off" in unfunded.startup_line()


def test_fmt_bytes() -> None:
    assert fmt_bytes(90.48 * GiB) == "90.48 GiB"
    assert fmt_bytes(180 * MiB) == "180 MiB"
    assert fmt_bytes(5.5 * MiB) == "5.50 MiB"
    assert fmt_bytes(2048) == "2.00 KiB"
    assert fmt_bytes(0) == "0 B"


def test_memory_budget() -> None:
    # CPU: TF_MEMORY_LIMIT_GIB is the memory; 32 GiB less 10 weights, 2 reserve, 1 activations.
    assert (
        memory_budget(
            device_free=None, weights=10 * GiB, reserve=2 * GiB, activations=GiB, limit_gib=32
        )
        == 19 * GiB
    )
    with pytest.raises(ValueError, match="TF_MEMORY_LIMIT_GIB"):
        memory_budget(device_free=None, weights=0, reserve=0, activations=0, limit_gib=None)
    # CUDA: free memory less what is still to load; a lower limit caps the free memory.
    assert (
        memory_budget(
            device_free=80 * GiB, weights=40 * GiB, reserve=2 * GiB, activations=GiB, limit_gib=None
        )
        == 37 * GiB
    )
    assert (
        memory_budget(
            device_free=80 * GiB, weights=0, reserve=2 * GiB, activations=GiB, limit_gib=20
        )
        == 17 * GiB
    )
    assert (
        memory_budget(device_free=80 * GiB, weights=0, reserve=0, activations=0, limit_gib=100)
        == 80 * GiB
    )
    assert (
        memory_budget(device_free=GiB, weights=2 * GiB, reserve=0, activations=0, limit_gib=None)
        == 0
    )


@st.composite
def rooms(draw: st.DrawFn) -> tuple[int, int, int, int, int, int | str, int, int]:
    """Random inputs; half the rooms sit near whole windows, where the modes part ways."""
    page_rows = draw(st.sampled_from([16, 64, 512]))
    page_bytes, fixed = draw(st.integers(1, 64 * MiB)), draw(st.integers(0, GiB))
    window, lanes = draw(st.integers(1, 1 << 21)), draw(st.integers(1, 32) | st.just("auto"))
    per = -(-window // page_rows) * page_bytes + fixed
    room = draw(
        st.integers(0, 200 * GiB)
        | st.integers(0, 33)
        .map(lambda n: n * per)
        .flatmap(lambda r: st.integers(max(0, r - page_bytes), r + page_bytes))
    )
    return (
        room,
        page_rows,
        page_bytes,
        fixed,
        window,
        lanes,
        draw(st.integers(0, 32 * GiB)),
        draw(st.integers(0, 4 * GiB)),
    )


@settings(max_examples=500, deadline=None)
@given(rooms())
def test_pages_never_worse_than_windows(
    args: tuple[int, int, int, int, int, int | str, int, int],
) -> None:
    room, page_rows, page_bytes, fixed, window, lanes, cache, snapshot = args

    def go(paging: str) -> Plan | None:
        try:
            p = mk(
                room,
                lanes,
                paging,
                window,
                cache,
                snapshot,
                rows=page_rows,
                page=page_bytes,
                fixed=fixed,
            )
        except PlanRefused:
            return None
        # Never more bytes than the room, and the cache within its budget.
        assert p.pages * p.page_bytes + p.lanes * fixed + p.cache_bytes + p.snapshot_bytes <= room
        assert p.left_bytes >= 0 and p.cache_bytes + p.snapshot_bytes <= cache
        assert p.total_bytes + p.left_bytes == room
        return p

    w, p = go("off"), go("on")
    if w is not None:
        assert p is not None, "windows fit but pages were refused"
        assert p.lanes == w.lanes
        assert p.pages * page_rows >= w.lanes * window
        assert p.total_rows >= w.total_rows and p.windows_held >= w.windows_held
