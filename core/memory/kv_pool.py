"""The pool's pages: who holds which page, promises, leases and the census.

Invariant (checked by census()): every page is free, held by live streams, or held by the prompt
store; `promised` pages are free pages already promised to admitted streams, so an admitted
stream never fails for memory. A page may be held by several holders at once (a stream and the
store share kept prompt pages); it is free when nothing holds it. The census counts a page that
streams hold as live, whether or not the store keeps it too (`shared`), so that live is what the
lanes hold; store is the pages the store alone holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


class PoolExhausted(RuntimeError):
    """Taking a page that was never promised, with no free page left (a scheduling bug)."""


@dataclass(frozen=True)
class Census:
    promised: int
    free: int
    store: int
    live: int
    total: int
    host: tuple[int, int, int] | None = None  # the host tier's free, store and total pages
    shared: int = 0  # live pages the prompt store keeps too

    @property
    def idle_even(self) -> bool:
        host_even = self.host is None or self.host[0] + self.host[1] == self.host[2]
        return (
            self.promised == 0
            and self.live == 0
            and self.free + self.store == self.total
            and host_even
        )

    def line(self) -> str:
        line = (
            f"kv pool idle: promised {self.promised}, free {self.free} + store {self.store} "
            f"== total {self.total}"
        )
        if self.host is not None:
            free, store, total = self.host
            line += f"; host free {free} + store {store} == total {total}"
        return line


class KVPool:
    """Page accounting (no tensors): the storage lives in the family's PagedRows."""

    def __init__(self, num_pages: int, page_rows: int = 512, poison: bool = False):
        if num_pages < 1:
            raise ValueError("a pool needs at least one page")
        self.num_pages = num_pages
        self.page_rows = page_rows
        self.poison_freed = poison
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._refs = [0] * num_pages
        self._store_refs = [0] * num_pages
        self.promised = 0
        self.store_pages = 0  # pages the prompt store holds (alone or with streams)
        self.on_freed: list[Callable[[Sequence[int]], None]] = []
        # The host tier's census (free, store, total), where the prompt store has one: free
        # host pages, and host pages its kept states hold.
        self.host_census: Callable[[], tuple[int, int, int]] | None = None

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_rows)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free pages not promised to anyone."""
        return len(self._free) - self.promised

    def can_promise(self, pages: int) -> bool:
        return pages <= self.available

    def lease(self, rows: int, attached: int = 0) -> "Lease":
        """Promise pages for `rows` rows, less `attached` pages the stream will attach from the
        store; raises PoolExhausted when they can't be promised (callers check can_promise
        first and wait instead)."""
        need = self.pages_for(rows) - attached
        if not self.can_promise(need):
            raise PoolExhausted(f"{need} pages asked, {self.available} can be promised")
        self.promised += need
        return Lease(self, need)

    def _take(self) -> int:
        if not self._free:
            raise PoolExhausted("no free page")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def take_for_store(self, n: int) -> list[int]:
        """n free pages, not promised to anyone, held by the prompt store alone (a state copied
        back from the host tier); the caller checks can_promise(n) first."""
        if not self.can_promise(n):
            raise PoolExhausted(f"{n} pages asked for the store, {self.available} can be taken")
        pages = [self._take() for _ in range(n)]
        for p in pages:
            self._store_refs[p] = 1
        self.store_pages += n
        return pages

    def hold(self, pages: Sequence[int], store: bool = False) -> None:
        """Add a holder to pages that someone already holds."""
        for p in pages:
            assert self._refs[p] > 0, f"page {p} is free"
            self._refs[p] += 1
            if store:
                self._store_refs[p] += 1
                self.store_pages += self._store_refs[p] == 1

    def drop(self, pages: Sequence[int], store: bool = False) -> None:
        """Remove a holder; pages nothing holds become free (and are poisoned if asked)."""
        freed = []
        for p in pages:
            assert self._refs[p] > 0, f"page {p} dropped while free"
            self._refs[p] -= 1
            if store:
                self._store_refs[p] -= 1
                self.store_pages -= self._store_refs[p] == 0
            if self._refs[p] == 0:
                freed.append(p)
        self._free.extend(reversed(freed))
        if freed and self.poison_freed:
            for fn in self.on_freed:
                fn(freed)

    def census(self) -> Census:
        """free + live + store == total: live, the pages streams hold (a holder beyond the
        store's), `shared` of them kept by the store too; store, those it alone holds."""
        live = store = shared = 0
        for refs, store_refs in zip(self._refs, self._store_refs):
            if refs > store_refs:
                live += 1
                shared += store_refs > 0
            elif refs:
                store += 1
        host = self.host_census() if self.host_census is not None else None
        return Census(self.promised, self.free, store, live, self.num_pages, host, shared)


class Lease:
    """A stream's promise and the pages it took: its page table."""

    def __init__(self, pool: KVPool, promised: int):
        self.pool = pool
        self.promised = promised
        self.pages: list[int] = []
        self.released = False

    def attach(self, pages: Sequence[int]) -> None:
        """Start the table with pages someone else holds (kept prompt pages), adding a holder."""
        assert not self.pages, "attach comes before any page is taken"
        self.pool.hold(pages)
        self.pages = list(pages)

    def cover(self, rows: int) -> list[int]:
        """Take pages (from the promise) until rows [0, rows) are covered; returns the table."""
        need = self.pool.pages_for(rows)
        while len(self.pages) < need:
            if self.promised <= 0:
                raise PoolExhausted(
                    f"rows up to {rows} need {need} pages; the lease took {len(self.pages)} and "
                    "has no promise left"
                )
            self.promised -= 1
            self.pool.promised -= 1
            self.pages.append(self.pool._take())
        return self.pages

    def trim(self, rows: int) -> None:
        """Give back the pages past those rows [0, rows) need, into the promise (a verify round's
        rejected draft rows): the lease may take them again, the census stays even."""
        keep = self.pool.pages_for(rows)
        if len(self.pages) <= keep:
            return
        pages, self.pages = self.pages[keep:], self.pages[:keep]
        self.promised += len(pages)
        self.pool.promised += len(pages)
        self.pool.drop(pages)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.pool.promised -= self.promised
        self.promised = 0
        pages, self.pages = self.pages, []
        self.pool.drop(pages)
