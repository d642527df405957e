"""The prompt store's host-memory tier: kept states the device store evicts are copied to host
memory (pinned on CUDA) with their snapshots, and a later hit copies them back into pool pages
instead of prefilling them again.

The tier is storage and accounting only; the prompt store (prompt_share) decides what moves.
Host pages mirror the pool's pages (every paged buffer, page by page); host snapshot slots
mirror the snapshot arena's pages. Both are allocated once at start: nothing is allocated per
eviction. On the CPU device the host memory is ordinary memory, by the same code path.

Copies run on a side CUDA stream when there is one: a copy out waits for the round that wrote
the pages and is complete before the device pages are given back (they may be written again at
once); a copy in is ordered before the next round by the compute stream waiting on the side
stream. Overlapping the copy out with the round is not done yet: it waits where it is issued.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..ops.kv_quant import index_copy_rows
from .kv_plan import GiB


@dataclass(eq=False)
class HostCopy:
    """A kept state's pages (in page-table order) and snapshot slot in host memory."""

    pages: list[int]
    slot: int | None  # None: the family keeps no fixed state (nothing to snapshot)


def host_budget(setting_gib: float | None, share: float, available: int | None) -> int:
    """The tier's bytes: TF_KV_HOST_GIB when set (0: off), else `share` of the host memory
    available now (0 when that is unknown)."""
    if setting_gib is not None:
        return int(setting_gib * GiB)
    return int((available or 0) * share)


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostTier:
    """`num_pages` host pages shaped like `rows`' pages, `num_slots` snapshot slots shaped like
    `arena`'s pages. `poison`: released host pages and slots are filled with NaN (TF_KV_POISON),
    so a copy back of a stale page changes tokens."""

    def __init__(
        self,
        rows: Any,
        arena: Any,
        num_pages: int,
        num_slots: int,
        device: str,
        poison: bool = False,
    ):
        pin = device.startswith("cuda") and torch.cuda.is_available()
        self.device = device
        self.page_rows = rows.page_rows
        self.num_pages = num_pages
        self.num_slots = num_slots if arena.buffers else 0
        self.poison = poison
        self.pages = {
            name: torch.empty(
                num_pages, rows.page_rows, *buf.shape[1:], dtype=buf.dtype, pin_memory=pin
            )
            for name, buf in rows.buffers.items()
        }
        self.slots = {
            name: torch.empty(self.num_slots, *buf.shape[1:], dtype=buf.dtype, pin_memory=pin)
            for name, buf in arena.buffers.items()
        }
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self.stream = torch.cuda.Stream(torch.device(device)) if pin else None
        self.pages_out = 0  # pages copied out and back in, for the logs and tests
        self.pages_in = 0

    @property
    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.pages.values(), *self.slots.values())
        )

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def fits(self, pages: int) -> bool:
        """Whether a state of `pages` pages could ever be held (with every host page free)."""
        return pages <= self.num_pages and (self.num_slots > 0 or not self.slots)

    def can_take(self, pages: int) -> bool:
        return pages <= len(self._free_pages) and (bool(self._free_slots) or not self.slots)

    # -- copies -------------------------------------------------------------------------------

    def page_out(self, rows: Any, arena: Any, pages: Sequence[int], snapshot: Any) -> HostCopy:
        """Copy pool pages (and the snapshot's arena page, if the family keeps fixed state) into
        host pages; complete when it returns, so the device pages may be reused."""
        assert self.can_take(len(pages)), "page_out without room (the caller makes room)"
        host = [self._free_pages.pop() for _ in pages]
        slot = self._free_slots.pop() if self.slots else None
        with self._on_side_stream():
            dst = torch.tensor(host, dtype=torch.long)
            for name, buf in rows.buffers.items():
                src = torch.tensor(list(pages), dtype=torch.long, device=buf.device)
                view = buf.view(rows.num_pages, rows.page_rows, *buf.shape[1:])
                index_copy_rows(self.pages[name], dst, view.index_select(0, src).to("cpu"))
            if slot is not None:
                for name, buf in arena.buffers.items():
                    self.slots[name][slot].copy_(buf[snapshot.page])
        if self.stream is not None:
            self.stream.synchronize()
        self.pages_out += len(pages)
        return HostCopy(host, slot)

    def page_in(
        self, copy: HostCopy, rows: Any, arena: Any, pages: Sequence[int], snapshot: Any
    ) -> None:
        """Copy a host copy back into pool pages `pages` (and the snapshot's arena page); the
        next round on the compute stream is ordered after it."""
        assert len(pages) == len(copy.pages)
        with self._on_side_stream():
            src = torch.tensor(copy.pages, dtype=torch.long)
            for name, buf in rows.buffers.items():
                dst = torch.tensor(list(pages), dtype=torch.long, device=buf.device)
                view = buf.view(rows.num_pages, rows.page_rows, *buf.shape[1:])
                index_copy_rows(
                    view,
                    dst,
                    self.pages[name].index_select(0, src).to(buf.device, non_blocking=True),
                )
            if copy.slot is not None:
                for name, buf in arena.buffers.items():
                    buf[snapshot.page].copy_(self.slots[name][copy.slot], non_blocking=True)
        if self.stream is not None:
            torch.cuda.current_stream(torch.device(self.device)).wait_stream(self.stream)
        self.pages_in += len(pages)

    def release(self, copy: HostCopy) -> None:
        """Give a copy's host pages and slot back (poisoned if asked)."""
        if self.poison:
            idx = torch.tensor(copy.pages, dtype=torch.long)
            for t in self.pages.values():
                t[idx] = float("nan")
            if copy.slot is not None:
                for t in self.slots.values():
                    t[copy.slot] = float("nan")
        self._free_pages.extend(reversed(copy.pages))
        if copy.slot is not None:
            self._free_slots.append(copy.slot)
        copy.pages, copy.slot = [], None

    def _on_side_stream(self) -> Any:
        """The side stream (after what the compute stream has queued), or nothing on the CPU."""
        if self.stream is None:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(torch.device(self.device)))
        return torch.cuda.stream(self.stream)
