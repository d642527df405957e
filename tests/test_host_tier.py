"""The prompt store's host tier on the CPU: copies out and back are bit-exact, states the device
store evicts move there and come back on a match, and the census counts host pages (a lost one
is UNEVEN)."""

from __future__ import annotations

import torch

from tensorfold.adapters import paged_kv
from tensorfold.adapters.paged_kv import PagedRows
from tensorfold.adapters.snapshots import SnapshotArena
from tensorfold.family import RowSpec, StateSpec
from tensorfold.memory.host_tier import HostTier, host_budget
from tensorfold.memory.kv_plan import GiB
from tensorfold.memory.kv_pool import KVPool
from tensorfold.memory.prompt_share import PromptSharing

ROWS = 4


class Runner:
    """Just the storage a PromptSharing touches: pages, one slot of fixed state."""

    def __init__(self, pages: int) -> None:
        self.pool = KVPool(pages, ROWS, poison=True)
        self.rows = PagedRows([RowSpec("k", (2, 3))], pages, ROWS)
        self.rows.buffers["k"].fill_(float("nan"))
        self.pool.on_freed.append(self.rows.poison)
        self.slot = torch.zeros(5)

    def keep_state(self, hooks, arena, slot, tap):
        snap = arena.lease()
        arena.buffers["s"][snap.page].copy_(self.slot)
        return snap

    def restore_state(self, hooks, arena, snapshot, slot):
        self.slot.copy_(arena.buffers["s"][snapshot.page])
        return True

    def attach(self, hooks, lease, kept_pages, kept_rows):
        return paged_kv.share_attach(lease, self.rows, kept_pages, kept_rows)


def write(runner: Runner, lease, tokens: list[int]) -> None:
    """Rows whose values are their tokens, and the slot's state after them."""
    pages = lease.cover(len(tokens))
    for t, tok in enumerate(tokens):
        runner.rows.buffers["k"][pages[t // ROWS] * ROWS + t % ROWS] = float(tok)
    runner.slot.fill_(float(sum(tokens)))


def keep_chats(runner: Runner, share: PromptSharing, n: int) -> list[list[int]]:
    """Keeps `n` chats of 6 rows (2 pages each), chat c's tokens c * 100 + t, one at a time."""
    chats = [[c * 100 + t for t in range(6)] for c in range(n)]
    for tokens in chats:
        lease = runner.pool.lease(len(tokens))
        write(runner, lease, tokens)
        share.keep(tokens, lease.pages, 0, None)
        lease.release()
    return chats


def sharing(host_pages: int, host_slots: int = 8) -> tuple[Runner, PromptSharing]:
    runner = Runner(12)
    arena = SnapshotArena([StateSpec("s", (5,))], 2)
    host = HostTier(runner.rows, arena, host_pages, host_slots, "cpu", poison=True)
    share = PromptSharing(
        pool=runner.pool,
        runner=runner,
        arena=arena,
        hooks=None,
        max_states=2,
        cache_pages=4,
        mark_rows=2,
        grid=2048,
        host=host,
    )
    return runner, share


def test_copies_out_and_back_are_exact() -> None:
    rows = PagedRows([RowSpec("k", (2, 3)), RowSpec("v", (4,), dtype="bfloat16")], 6, ROWS)
    for buf in rows.buffers.values():
        buf.copy_(torch.randn(buf.shape).to(buf.dtype))
    arena = SnapshotArena([StateSpec("s", (5,))], 2)
    arena.buffers["s"].copy_(torch.randn(2, 5))
    before = {n: b.clone() for n, b in rows.buffers.items()}
    snap = arena.lease()
    kept_snap = arena.buffers["s"][snap.page].clone()
    tier = HostTier(rows, arena, 4, 2, "cpu", poison=True)
    copy = tier.page_out(rows, arena, [1, 3], snap)
    rows.poison([1, 3])
    arena.buffers["s"][snap.page] = float("nan")
    tier.page_in(copy, rows, arena, [5, 0], snap)
    for name, buf in rows.buffers.items():
        view, was = buf.view(6, ROWS, *buf.shape[1:]), before[name].view(6, ROWS, *buf.shape[1:])
        assert torch.equal(view[5], was[1]) and torch.equal(view[0], was[3])
    assert torch.equal(arena.buffers["s"][snap.page], kept_snap)
    used = list(copy.pages)
    tier.release(copy)
    assert tier.free_pages == 4 and torch.isnan(tier.pages["k"][used]).all()
    assert torch.isnan(tier.pages["v"][used].float()).all()


def test_evicted_states_move_to_the_host_and_come_back() -> None:
    runner, share = sharing(host_pages=8)
    chats = keep_chats(runner, share, 4)
    # Two states fit the device (and 4 pages): the first two chats moved to the host.
    assert share.device_states == 2 and share.on_host == 2 and share.evictions == 2
    assert runner.pool.census().idle_even
    assert runner.pool.census().host == (4, 4, 8)
    kept = share.match(chats[0] + [7])
    assert kept is not None and kept.pos == 6 and kept.host is None and share.host_hits == 1
    lease = runner.pool.lease(8, attached=1)
    share.resume(kept, lease, 0)
    table = lease.cover(6)
    got = [
        runner.rows.buffers["k"][table[t // ROWS] * ROWS + t % ROWS, 0, 0].item() for t in range(6)
    ]
    assert got == chats[0] and runner.slot[0].item() == sum(chats[0])
    lease.release()
    census = runner.pool.census()
    assert census.idle_even, census.line()
    assert census.line().endswith("; host free 4 + store 4 == total 8")  # chat 2 moved out


def test_a_lost_host_page_is_uneven() -> None:
    runner, share = sharing(host_pages=8)
    keep_chats(runner, share, 3)
    on_host = next(k for k in share.store.kept() if k.host is not None)
    on_host.host.pages.pop()  # a page the tier handed out that no state accounts for
    assert not runner.pool.census().idle_even


def test_a_full_host_tier_drops_its_least_recently_used() -> None:
    runner, share = sharing(host_pages=2)  # one state of 2 pages
    keep_chats(runner, share, 4)
    assert share.on_host == 1 and share.host_evictions == 1 and len(share.store) == 3
    assert share.match([100 + t for t in range(6)] + [1]).pos == 6  # chat 1 on the host
    assert share.match([0, 1, 2, 3, 4, 5, 6]) is None  # chat 0 was dropped
    assert runner.pool.census().idle_even


def test_the_host_budget() -> None:
    assert host_budget(0, 0.25, 64 * GiB) == 0
    assert host_budget(1.5, 0.25, 64 * GiB) == int(1.5 * GiB)
    assert host_budget(None, 0.25, 64 * GiB) == 16 * GiB
    assert host_budget(None, 0.25, None) == 0
