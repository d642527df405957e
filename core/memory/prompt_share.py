"""The prompt store's side of the lanes: resume at admission, keeps at marks inside passes,
eviction when streams are short of pages or the store is over its budget.

With a host tier (host_tier.HostTier), a state the device store evicts moves to host memory
instead of being dropped (the host tier drops its own least recently used states to make room),
and a later match copies it back into pool pages before it is resumed, as a device state is."""

from __future__ import annotations

import time
from typing import Any, Sequence

from ..config.logs import get_logger
from .kv_pool import KVPool, Lease
from .prompt_radix import Kept, RadixStore

log = get_logger("tensorfold.prompt_share")


class PromptSharing:
    """`max_states`: kept states on the device in all (TF_KV_SHARE); `cache_pages`: pages the
    store may hold. `mark_rows`: usable marks are multiples of it (the family's granularity);
    `grid`: the pass grid, whose multiples are marks too. `host`: the host tier, or None."""

    def __init__(
        self,
        *,
        pool: KVPool,
        runner: Any,
        arena: Any,
        hooks: Any,
        max_states: int,
        cache_pages: int,
        mark_rows: int,
        grid: int,
        host: Any = None,
    ):
        self.pool = pool
        self.runner = runner
        self.arena = arena
        self.hooks = hooks
        self.max_states = max_states
        self.cache_pages = cache_pages
        self.mark_rows = mark_rows
        self.grid = grid
        self.host = host
        self.store = RadixStore(self._dropped)
        self.evictions = 0  # states the device store gave up (dropped, or moved to the host)
        self._host_kept: set[Kept] = set()  # states in the host tier now
        self.host_evictions = 0  # states the host tier dropped
        self.host_hits = 0  # states copied back from the host tier
        self._paging_in: Kept | None = None  # the state being copied back, spared by the host
        if host is not None:
            pool.host_census = self.host_census

    @property
    def on_host(self) -> int:
        return len(self._host_kept)

    @property
    def device_states(self) -> int:
        return len(self.store) - self.on_host

    # -- admission ----------------------------------------------------------------------------

    def match(self, prompt: Sequence[int], limit: int | None = None) -> Kept | None:
        """The longest kept prefix that leaves at least the prompt's last row to compute (and
        ends at or before `limit`, when given); a state in the host tier is copied back first
        (None when there is no room for it). `prompt` is the store's key of the prompt
        (media.store_key: its media rows keyed by their pixels)."""
        most = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        kept = self.store.lookup(prompt, most)
        if kept is not None and kept.host is not None and not self._page_in(kept):
            return None
        return kept

    def make_room(self, pages: int, keep: Kept | None = None) -> bool:
        """Evict least-recently-used device states (never `keep`) until `pages` can be
        promised."""
        while not self.pool.can_promise(pages):
            victim = self._lru_on_device(keep)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def resume(self, kept: Kept, lease: Lease, slot: int) -> int:
        """Attach the kept pages to the lease and restore the snapshot into the slot."""
        kept.hits += 1
        kept.used_at = time.monotonic()
        self.runner.attach(self.hooks, lease, kept.pages, kept.pos)
        # a family with no fixed state keeps empty snapshots, leased here without the runner, so
        # there is nothing to restore (and a TP follower never saw them)
        if kept.snapshot is not None and self.arena.buffers:
            self.runner.restore_state(self.hooks, self.arena, kept.snapshot, slot)
        return kept.pos

    # -- keeps --------------------------------------------------------------------------------

    def marks(self, prompt: Sequence[int], chat_marks: Sequence[int], start: int) -> list[int]:
        """Where to keep this prompt's state: the grid, the chat marks and the prompt's end,
        each moved down to a usable position (a multiple of mark_rows), past `start`, where
        the store does not hold a state yet."""
        n = len(prompt)
        wanted = set(range(self.grid, n + 1, self.grid)) | {m for m in chat_marks if m <= n}
        wanted.add(n)
        # a mark between the family's usable positions moves down to the last one before it
        usable = {m - m % self.mark_rows for m in wanted}
        return sorted(m for m in usable if m > start and self.store.has(prompt[:m]) is None)

    def keep(
        self, tokens: Sequence[int], pages: Sequence[int], slot: int, tap: tuple[int, int] | None
    ) -> None:
        """Keep the state after len(tokens) rows: the pages holding them and a snapshot of the
        fixed state (as the last pass tapped it at `tap`, or the slot's when None)."""
        pos = len(tokens)
        if pos % self.mark_rows or self.store.has(tokens) is not None:
            return
        while self.device_states >= self.max_states or self.arena.free == 0:
            victim = self._lru_on_device()
            if victim is None:
                return
            self._evict(victim)
        snapshot = None
        if self.arena.buffers:
            snapshot = self.runner.keep_state(self.hooks, self.arena, slot, tap)
        else:
            snapshot = self.arena.lease()
        held = list(pages[: self.pool.pages_for(pos)])
        self.pool.hold(held, store=True)
        kept = self.store.insert(list(tokens), held, snapshot)
        kept.used_at = time.monotonic()
        while self.pool.store_pages > self.cache_pages:
            victim = self._lru_on_device()
            if victim is None:
                break
            self._evict(victim)
            if victim is kept:
                break

    # -- eviction and the host tier -----------------------------------------------------------

    def _lru_on_device(self, keep: Kept | None = None) -> Kept | None:
        return min(
            (k for k in self.store.kept() if k.host is None and k is not keep),
            key=lambda k: k.last_used,
            default=None,
        )

    def _evict(self, kept: Kept) -> None:
        """The device store gives a state up: to the host tier where it has one and the state
        fits, else dropped."""
        self.evictions += 1
        if self.host is None or not self._host_room(len(kept.pages), kept):
            self.store.drop(kept)
            return
        copy = self.host.page_out(self.runner.rows, self.arena, kept.pages, kept.snapshot)
        self._release_device(kept)
        kept.host = copy
        self._host_kept.add(kept)

    def _host_room(self, pages: int, keep: Kept) -> bool:
        """Drop the host tier's least recently used states (never `keep`, nor a state being
        copied back) until a state of `pages` pages fits; False when it never would."""
        if not self.host.fits(pages):
            return False
        spare = (keep, self._paging_in)
        while not self.host.can_take(pages):
            victim = min(
                (k for k in self.store.kept() if k.host is not None and k not in spare),
                key=lambda k: k.last_used,
                default=None,
            )
            if victim is None:
                return False
            self.store.drop(victim)
            self.host_evictions += 1
        return True

    def _page_in(self, kept: Kept) -> bool:
        """Copy a host state back into pool pages the store holds (making room on the device
        as a keep would); False when there is no room, and it stays on the host."""
        n = len(kept.host.pages)
        self._paging_in = kept
        try:
            while (
                self.device_states >= self.max_states
                or self.arena.free == 0
                or self.pool.store_pages + n > self.cache_pages
                or not self.pool.can_promise(n)
            ):
                victim = self._lru_on_device(kept)
                if victim is None:
                    return False
                self._evict(victim)
        finally:
            self._paging_in = None
        pages = self.pool.take_for_store(n)
        snapshot = self.arena.lease()
        self.host.page_in(kept.host, self.runner.rows, self.arena, pages, snapshot)
        self.host.release(kept.host)
        kept.host, kept.pages, kept.snapshot = None, pages, snapshot
        self._host_kept.discard(kept)
        self.host_hits += 1
        return True

    def _release_device(self, kept: Kept) -> None:
        self.pool.drop(kept.pages, store=True)
        if kept.snapshot is not None:
            self.arena.release(kept.snapshot)
        kept.pages, kept.snapshot = [], None

    def _dropped(self, kept: Kept) -> None:
        if kept.host is not None:
            self.host.release(kept.host)
            kept.host = None
            self._host_kept.discard(kept)
        else:
            self._release_device(kept)

    def host_census(self) -> tuple[int, int, int]:
        """The host tier's free pages, the pages its kept states hold, and its total: they add
        up unless a host page was lost (or held twice). Read from /metrics' thread too: the
        set is copied in one step (under the GIL) before it is walked."""
        held = sum(len(copy.pages) for copy in [k.host for k in list(self._host_kept)] if copy)
        return self.host.free_pages, held, self.host.num_pages

    def clear(self) -> None:
        """Drop every kept state (on the device and on the host) and count from zero again."""
        self.store.clear()
        self.evictions = self.host_evictions = self.host_hits = 0
