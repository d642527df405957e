"""Decode rounds and verify passes under CUDA graphs.

`GraphRunner` is a ModelRunner whose decode passes (every stream one row that wants its logits,
no taps) replay a graph captured for the smallest lane-count bucket that holds them, so a round
costs one host-to-device copy and one replay instead of a launch per kernel; for a family with
`verify_graphs`, so do uniform verify passes (every stream R rows, R in VERIFY_ROWS: graphs
keyed (bucket, R), decode rounds being R = 1). Other passes run eagerly. A bucket's unused
streams point at a scratch page and a scratch slot that the pool never hands out; the kernels
are batch-invariant, so padding never changes a real row's bits.

The inputs live in one static flat int64 buffer: rows [3, bucket * R] (tokens, positions,
write rows), then streams [2 + max_pages, bucket] (slots, starts, then the page tables: page j
of every stream in row 2 + j). A round writes them on the host (page tables only when they
changed) and copies what it uses.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    import numpy as np

from ..config.logs import get_logger
from ..family.forward_pass import ForwardPass, StreamRows, uniform_verify
from ..family.model import FamilyModel
from ..memory.kv_pool import KVPool
from ..ops.gpu import use_triton
from ..ops.pass_meta import build_meta
from .runner import ModelRunner

log = get_logger("tensorfold.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# rows a stream of the verify passes replayed as graphs (k + 1 for k drafts; the lanes pad a
# pass's runs up to one of them)
VERIFY_ROWS = (2, 3, 5, 9, 17)
# draft rows (bucket x (R - 1)) of the largest verify graph: what the tap arena holds, a fixed
# state a row (ForwardPass.tap_space); counted in the serving plan (engine.start)
TAP_ROWS = 32


@dataclass
class _Graph:
    bucket: int  # streams
    rows_each: int  # rows a stream: 1 (a decode round) or a uniform verify pass's R
    fp: ForwardPass
    host: torch.Tensor  # the flat inputs (the module docstring), pinned
    dev: torch.Tensor  # the same on the device: the graph's inputs
    logits: torch.Tensor | None = None  # [bucket * rows_each, V]: the graph's output
    graph: "torch.cuda.CUDAGraph | None" = None
    np: "np.ndarray | None" = None  # host, as numpy (the same memory)
    width: int = 0  # streams the last round wrote; [width, bucket) hold padding
    need: int = -1  # page-table rows the last round wrote
    tables: list[list[int]] | None = None  # the page tables it wrote, column by column
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rows: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)
    refused: bool = False  # a verify graph whose capture or taps failed: run such passes eagerly

    @property
    def row_cells(self) -> int:
        """Where the streams' section starts in the flat inputs."""
        return 3 * self.bucket * self.rows_each


class GraphRunner(ModelRunner):
    def __init__(
        self,
        model: FamilyModel,
        *,
        num_pages: int,
        num_slots: int,
        page_rows: int = 512,
        poison: bool = False,
        plugin_manager=None,
        kv_dtype: str = "auto",
        max_pages: int | None = None,
        buckets: Sequence[int] = BUCKETS,
        capture: bool = True,
    ):
        # One more page and slot than asked for: the scratch rows that padding writes.
        super().__init__(
            model,
            num_pages=num_pages + 1,
            num_slots=num_slots + 1,
            page_rows=page_rows,
            poison=poison,
            plugin_manager=plugin_manager,
            kv_dtype=kv_dtype,
        )
        self.pool = KVPool(num_pages, page_rows, poison=poison)
        if poison:
            self.pool.on_freed.append(self.rows.poison)
        self.scratch_page = num_pages
        self.scratch_slot = num_slots
        self.max_pages = max_pages or num_pages
        self.buckets = sorted(b for b in buckets if b <= num_slots) or [num_slots]
        self.capture = capture and model.device.type == "cuda"
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.tap_rows = TAP_ROWS
        self._tap_arena: dict[str, torch.Tensor] | None = None
        self.replays = 0
        self.capture_error: str | None = None
        self._mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self._probe = torch.empty(0, device=model.device)
        self._copied: torch.cuda.Event | None = None

    # -- a round ------------------------------------------------------------------------------

    @torch.inference_mode()
    def release_graphs(self) -> None:
        """Drop the captured graphs (before a rank leaves NCCL: graphs that hold its kernels
        keep its communicator busy, and the teardown waits on them)."""
        self.graphs.clear()
        torch.cuda.synchronize()

    @torch.inference_mode()  # as ModelRunner.run: a graph built in it is its inference tensors
    def run(self, streams: Sequence[StreamRows]) -> list[torch.Tensor]:
        shape = self._shape(streams)
        if shape is None:
            return super().run(streams)
        return self._replay(shape, streams, None)

    @torch.inference_mode()
    def run_fed(self, streams: Sequence[StreamRows], tokens: torch.Tensor) -> list[torch.Tensor]:
        shape = self._shape(streams)
        if shape is None:
            return super().run_fed(streams, tokens)
        return self._replay(shape, streams, tokens)

    def verify_row_counts(self, streams: int) -> tuple[int, ...]:
        if not self.model.verify_graphs or not use_triton(self._probe):
            return ()
        bucket = next((b for b in self.buckets if b >= streams), None)
        if bucket is None:
            return ()
        return tuple(r for r in VERIFY_ROWS if bucket * (r - 1) <= self.tap_rows)

    def _replay(
        self, shape: tuple[int, int], streams: Sequence[StreamRows], tokens: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """A round through the graph of `shape` (streams bucket, rows a stream); tokens: a
        decode round's tokens on the device (copied into the graph's input after the host's
        columns), or None: the streams' own."""
        g = self.graphs.get(shape) or self._build(*shape)
        if g.refused:  # a verify graph the family could not give: its static pass is no pass
            return ModelRunner.run(self, streams)
        need = max(len(s.pages) for s in streams)
        self._fill(g, streams, need)
        if tokens is not None:
            g.dev[: len(streams)].copy_(tokens)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self.forward(g.fp)
        self.replays += 1
        if g.rows_each > 1:  # the taps' positions: from the streams it ran (ForwardPass.taps_at)
            g.fp.streams[: len(streams)] = streams
        self.last_pass = g.fp
        assert g.logits is not None
        n, r = len(streams), g.rows_each
        hit = g.rows.get(n)
        if hit is None or hit[0] is not g.logits:  # the graph's output is one static tensor
            hit = g.rows[n] = (g.logits, [g.logits[i * r : (i + 1) * r] for i in range(n)])
        return list(hit[1])  # a [rows_each, V] view a stream, made once

    @torch.inference_mode()
    def pass_prices(
        self, drafts: int, repeats: int = 5
    ) -> tuple[float, tuple[tuple[int, float], ...]] | None:
        """The draft policy's prices (DraftSettings.pass_cost, verify_costs), measured against a
        one-row decode pass's replay on the scratch slot and page (medians of `repeats`): with
        verify graphs, a pass_cost of 1 and the cost of each replayed verify pass of R rows
        (of R distinct tokens),
        for R in VERIFY_ROWS up to the one that holds `drafts` drafts; without, the eager
        one-row pass's cost (a verify pass then runs eagerly: drafts must pay for that) and
        no table. None where rounds are not captured."""
        one = [StreamRows(self.scratch_slot, 0, [0], [self.scratch_page])]
        if not self.capture or self._shape(one) is None:
            return None

        def median_s(fn: Any, run: list[StreamRows]) -> float:
            times = []
            for _ in range(repeats + 1):  # the first compiles or captures
                torch.cuda.synchronize()
                a = time.perf_counter()
                fn(run)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - a)
            return statistics.median(times[1:])

        plain = median_s(self.run, one)
        counts = self.verify_row_counts(1)
        if not counts:
            return median_s(lambda run: ModelRunner.run(self, run), one) / plain, ()
        table = []
        # distinct tokens: rows of one token would route to the same experts, and a MoE verify
        # pass then reads a fraction of the expert weights that real drafts make it read
        vocab = self.model.vocab_size
        for r in counts:
            taps = tuple(range(1, r))
            ids = [(7919 * (i + 1)) % vocab for i in range(r)]
            run = [StreamRows(self.scratch_slot, 0, ids, [self.scratch_page], "all", taps, True)]
            table.append((r, max(median_s(self.run, run) / plain, 1.0)))
            if r > drafts:
                break
        return 1.0, tuple(table)

    def _shape(self, streams: Sequence[StreamRows]) -> tuple[int, int] | None:
        """(bucket, rows a stream) of the graph that runs this pass, or None: run it eagerly.
        A decode round (one row a stream wanting its logits, no taps) or, for a family with
        `verify_graphs`, a uniform verify pass (ForwardPass.rows_each) of R in VERIFY_ROWS."""
        if not use_triton(self._probe):
            return None
        r = len(streams[0].tokens)
        if r == 1:
            if any(len(s.tokens) != 1 or s.logits != "last" or s.taps or s.embeds for s in streams):
                return None
        elif r not in self.verify_row_counts(len(streams)) or uniform_verify(streams) != r:
            return None
        elif any(s.logits != "all" for s in streams) or r > self.pool.page_rows:
            return None
        if max(len(s.pages) for s in streams) > self.max_pages:
            return None
        bucket = next((b for b in self.buckets if b >= len(streams)), None)
        return None if bucket is None else (bucket, r)

    def _fill(self, g: _Graph, streams: Sequence[StreamRows], need: int) -> None:
        """Write the round's inputs into the pinned host buffer (through a numpy view of it:
        no tensor is built per round) and copy what the round uses to the device. Page tables
        change only when a stream takes a page or the streams change: they are rewritten then,
        and otherwise left as the last round wrote them."""
        if self._copied is not None:
            self._copied.synchronize()  # the last round's copy has left the pinned buffer
        rows = self.pool.page_rows
        b, r = len(streams), g.rows_each
        h = g.np
        assert h is not None  # made with the graph
        cells = g.row_cells
        per_row = h[:cells].reshape(3, g.bucket * r)
        per_stream = h[cells:].reshape(-1, g.bucket)
        if r == 1:
            per_row[:, :b] = [
                [s.tokens[0] for s in streams],
                [s.start for s in streams],
                [s.pages[s.start // rows] * rows + s.start % rows for s in streams],
            ]
        else:
            positions = [p for s in streams for p in range(s.start, s.end)]
            per_row[:, : b * r] = [
                [t for s in streams for t in s.tokens],
                positions,
                [
                    s.pages[p // rows] * rows + p % rows
                    for s in streams
                    for p in range(s.start, s.end)
                ],
            ]
        per_stream[:2, :b] = [[s.slot for s in streams], [s.start for s in streams]]
        tables = [s.pages for s in streams]
        if need != g.need or tables != g.tables:
            for i, pages in enumerate(tables):
                per_stream[2 : 2 + len(pages), i] = pages
                per_stream[2 + len(pages) : 2 + need, i] = self.scratch_page
            g.tables, g.need = [list(p) for p in tables], need
        if b != g.width:  # streams [b, bucket) are padding again
            self._pad(g, b)
            g.width = b
        used = cells + (2 + need) * g.bucket
        dev, host = g.copies.get(need) or g.copies.setdefault(need, (g.dev[:used], g.host[:used]))
        dev.copy_(host, non_blocking=True)
        if g.dev.is_cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()  # one event, recorded again each round

    def _pad(self, g: _Graph, a: int) -> None:
        """Streams [a, bucket): a fresh stream at position 0 on the scratch page and slot."""
        assert g.np is not None
        b, r = g.bucket, g.rows_each
        if a >= b:
            return
        per_row = g.np[: g.row_cells].reshape(3, b * r)
        per_stream = g.np[g.row_cells :].reshape(-1, b)
        per_row[0, a * r :] = 0
        per_row[1, a * r :] = list(range(r)) * (b - a)
        per_row[2, a * r :] = [self.scratch_page * self.pool.page_rows + j for j in range(r)] * (
            b - a
        )
        per_stream[0, a:] = self.scratch_slot
        per_stream[1, a:] = 0
        per_stream[2:, a:] = self.scratch_page

    # -- capture ------------------------------------------------------------------------------

    def _build(self, bucket: int, rows_each: int) -> _Graph:
        device = self.model.device
        cells = 3 * bucket * rows_each + (2 + self.max_pages) * bucket
        host = torch.empty(cells, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(device)
        if dev.data_ptr() == host.data_ptr():  # on the CPU: the graph's inputs are their own
            dev = host.clone()
        g = _Graph(bucket, rows_each, None, host, dev, np=host.numpy())  # type: ignore[arg-type]
        self._pad(g, 0)
        g.width = bucket
        g.dev.copy_(g.host)
        g.fp = self._static_pass(g)
        if rows_each > 1:
            g.fp.tap_arena, g.fp.tap_arena_rows = self.tap_arena(), self.tap_rows
        if self.capture:
            try:
                g.logits, g.graph = self._capture(g.fp)
                self._check_taps(g.fp)
            except Exception as exc:  # run this shape eagerly, and say why
                self.capture_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "CUDA graph capture failed; these passes run eagerly",
                    bucket=bucket,
                    rows_each=rows_each,
                    error=self.capture_error,
                )
                g.graph = None
                g.refused = rows_each > 1
                torch.cuda.synchronize()
        self.graphs[(bucket, rows_each)] = g
        return g

    def tap_arena(self) -> dict[str, torch.Tensor]:
        """The verify graphs' taps by row: `tap_rows` fixed states of each name a family taps
        into it (ForwardPass.tap_space adds a name on its first use, in the uncaptured passes
        before a capture: a graph's own allocations would be its alone)."""
        if self._tap_arena is None:
            self._tap_arena = {}
        return self._tap_arena

    def _check_taps(self, fp: ForwardPass) -> None:
        """A verify graph's taps must be the rows' (tap_rows), one for each fixed state: a tap by
        position would name the capture's positions, not a replay's."""
        if fp.rows_each and (fp.tapped or set(fp.row_taps) != set(self.slots.buffers)):
            raise RuntimeError(
                f"{self.model.name}'s verify pass tapped {sorted(set(fp.row_taps))} by row and "
                f"{len(fp.tapped)} by position; a graph needs every fixed state "
                f"({sorted(self.slots.buffers)}) tapped by row (ForwardPass.tap_rows)"
            )
        counted = {s.name for s in self.layout.fixed if s.arena_taps}
        if fp.tap_arena and not set(fp.tap_arena) <= counted:
            raise RuntimeError(
                f"{self.model.name}'s verify pass tapped {sorted(set(fp.tap_arena) - counted)} "
                "in the tap arena, which the serving plan does not count: mark those states "
                "StateSpec(arena_taps=True)"
            )

    def _capture(self, fp: ForwardPass) -> "tuple[torch.Tensor, torch.cuda.CUDAGraph]":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles every kernel before the capture
                self.forward(fp)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            logits = self.forward(fp)
        return logits, graph

    def _static_pass(self, g: _Graph) -> ForwardPass:
        """A pass of `g.bucket` streams of `g.rows_each` rows whose varying tensors are views of
        `g.dev` (its host-side streams are placeholders: the family reads the device meta)."""
        rows, r, bucket, dev = self.pool.page_rows, g.rows_each, g.bucket, g.dev
        streams = [
            StreamRows(
                self.scratch_slot,
                0,
                [0] * r,
                [self.scratch_page],
                "all" if r > 1 else "last",
                tuple(range(1, r)),
                rewind=r > 1,
            )
            for _ in range(bucket)
        ]
        fp = ForwardPass(streams, rows, self.model.device)
        per_row = dev[: g.row_cells].view(3, bucket * r)
        per_stream = dev[g.row_cells :].view(-1, bucket)
        fp.tokens, fp.positions, fp.write_index = per_row[0], per_row[1], per_row[2]
        fp.logit_rows = torch.arange(bucket * r, dtype=torch.int64, device=dev.device)
        shape = build_meta(fp)  # what the stream count and R fix: rows, streams, blocks
        fp.device_meta = replace(  # type: ignore[attr-defined]
            shape, stream_slot=per_stream[0], stream_start=per_stream[1], table=per_stream[2:].t()
        )
        return fp
