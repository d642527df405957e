"""The prompt store's side of the lanes: resume at admission, keeps at marks inside passes,
eviction when streams are short of pages or the store is over its budget."""

from __future__ import annotations

from typing import Any, Sequence

from .kv_pool import KVPool, Lease
from .logs import get_logger
from .prompt_radix import Kept, RadixStore

log = get_logger("tensorfold.prompt_share")


class PromptSharing:
    """`max_states`: kept states in all (TF_KV_SHARE); `cache_pages`: pages the store may hold.
    `mark_rows`: usable marks are multiples of it (the family's granularity); `grid`: the pass
    grid, whose multiples are marks too."""

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
    ):
        self.pool = pool
        self.runner = runner
        self.arena = arena
        self.hooks = hooks
        self.max_states = max_states
        self.cache_pages = cache_pages
        self.mark_rows = mark_rows
        self.grid = grid
        self.store = RadixStore(self._dropped)
        self.evictions = 0

    # -- admission ----------------------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> Kept | None:
        """The longest kept prefix that leaves at least the prompt's last row to compute."""
        return self.store.lookup(prompt, len(prompt) - 1)

    def make_room(self, pages: int, keep: Kept | None = None) -> bool:
        """Evict least-recently-used states (never `keep`) until `pages` can be promised."""
        while not self.pool.can_promise(pages):
            victim = min(
                (k for k in self.store.kept() if k is not keep),
                key=lambda k: k.last_used,
                default=None,
            )
            if victim is None:
                return False
            self._evict(victim)
        return True

    def resume(self, kept: Kept, lease: Lease, slot: int) -> int:
        """Attach the kept pages to the lease and restore the snapshot into the slot."""
        self.runner.attach(self.hooks, lease, kept.pages, kept.pos)
        if kept.snapshot is not None:
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
        while len(self.store) >= self.max_states or self.arena.free == 0:
            if self.store.evict_lru() is None:
                return
            self.evictions += 1
        snapshot = None
        if self.arena.buffers:
            snapshot = self.runner.keep_state(self.hooks, self.arena, slot, tap)
        else:
            snapshot = self.arena.lease()
        held = list(pages[: self.pool.pages_for(pos)])
        self.pool.hold(held, store=True)
        kept = self.store.insert(list(tokens), held, snapshot)
        while self.pool.store_pages > self.cache_pages:
            victim = self.store.evict_lru()
            self.evictions += 1
            if victim is kept or victim is None:
                break

    def _evict(self, kept: Kept) -> None:
        self.store.drop(kept)
        self.evictions += 1

    def _dropped(self, kept: Kept) -> None:
        self.pool.drop(kept.pages, store=True)
        if kept.snapshot is not None:
            self.arena.release(kept.snapshot)

    def clear(self) -> None:
        self.store.clear()
