"""Decode rounds under CUDA graphs.

`GraphRunner` is a ModelRunner whose decode passes (every stream one row that wants its logits,
no taps) replay a graph captured for the smallest lane-count bucket that holds them, so a round
costs one host-to-device copy and one replay instead of a launch per kernel. Other passes run
eagerly. A bucket's unused rows point at a scratch page and a scratch slot that the pool never
hands out; the kernels are batch-invariant, so padding never changes a real row's bits.

The inputs live in one static int64 buffer [4 + max_pages, bucket]: tokens, positions, write
rows, slots, then the page tables (page j of every stream in row 4 + j). A round writes its
columns on the host (page tables only when they changed) and copies the rows it uses.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    import numpy as np

from ..config.logs import get_logger
from ..family.forward_pass import ForwardPass, StreamRows
from ..family.model import FamilyModel
from ..memory.kv_pool import KVPool
from ..ops.gpu import use_triton
from ..ops.pass_meta import PassMeta
from .runner import ModelRunner

log = get_logger("tensorfold.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass
class _Graph:
    bucket: int
    fp: ForwardPass
    host: torch.Tensor  # [4 + max_pages, bucket] int64, pinned
    dev: torch.Tensor  # the same on the device: the graph's inputs
    logits: torch.Tensor | None = None  # [bucket, V]: the graph's output
    graph: "torch.cuda.CUDAGraph | None" = None
    np: "np.ndarray | None" = None  # host, as numpy (the same memory)
    width: int = 0  # columns the last round wrote; [width, bucket) hold padding
    need: int = -1  # page-table rows the last round wrote
    tables: list[list[int]] | None = None  # the page tables it wrote, column by column
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    rows: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = field(default_factory=dict)


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
        self.graphs: dict[int, _Graph] = {}
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

    def run(self, streams: Sequence[StreamRows]) -> list[torch.Tensor]:
        bucket = self._bucket(streams)
        if bucket is None:
            return super().run(streams)
        return self._replay(bucket, streams, None)

    def run_fed(self, streams: Sequence[StreamRows], tokens: torch.Tensor) -> list[torch.Tensor]:
        bucket = self._bucket(streams)
        if bucket is None:
            return super().run_fed(streams, tokens)
        return self._replay(bucket, streams, tokens)

    def _replay(
        self, bucket: int, streams: Sequence[StreamRows], tokens: torch.Tensor | None
    ) -> list[torch.Tensor]:
        """A decode round through `bucket`'s graph; tokens: the rows' tokens on the device
        (copied into the graph's input after the host's columns), or None: the streams' own."""
        g = self.graphs.get(bucket) or self._build(bucket)
        need = max(len(s.pages) for s in streams)
        self._fill(g, streams, need)
        if tokens is not None:
            g.dev[0, : len(streams)].copy_(tokens)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits = self.forward(g.fp)
        self.replays += 1
        self.last_pass = g.fp
        assert g.logits is not None
        n = len(streams)
        hit = g.rows.get(n)
        if hit is None or hit[0] is not g.logits:  # the graph's output is one static tensor
            hit = g.rows[n] = (g.logits, [g.logits[i : i + 1] for i in range(n)])
        return list(hit[1])  # a [1, V] view a stream, made once

    @torch.inference_mode()
    def eager_over_graphed(self, repeats: int = 5) -> float | None:
        """How many times a one-row pass run eagerly costs its graph's replay (the median of
        `repeats` each, on the scratch slot and page), or None where rounds are not captured.
        A verify pass (k + 1 rows a stream) runs eagerly: the draft policy's price."""
        run = [StreamRows(self.scratch_slot, 0, [0], [self.scratch_page])]
        if not self.capture or self._bucket(run) is None:
            return None

        def median_s(fn: Any) -> float:
            times = []
            for _ in range(repeats + 1):  # the first compiles or captures
                torch.cuda.synchronize()
                a = time.perf_counter()
                fn(run)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - a)
            return statistics.median(times[1:])

        eager = median_s(lambda r: ModelRunner.run(self, r))
        return eager / median_s(self.run)

    def _bucket(self, streams: Sequence[StreamRows]) -> int | None:
        if not use_triton(self._probe):
            return None
        if any(len(s.tokens) != 1 or s.logits != "last" or s.taps for s in streams):
            return None
        if max(len(s.pages) for s in streams) > self.max_pages:
            return None
        return next((b for b in self.buckets if b >= len(streams)), None)

    def _fill(self, g: _Graph, streams: Sequence[StreamRows], need: int) -> None:
        """Write the round's columns into the pinned host buffer (through a numpy view of it: no
        tensor is built per round) and copy its first 4 + need rows to the device. Page tables
        change only when a stream takes a page or the streams change: they are rewritten then,
        and otherwise left as the last round wrote them."""
        if self._copied is not None:
            self._copied.synchronize()  # the last round's copy has left the pinned buffer
        rows = self.pool.page_rows
        b = len(streams)
        h = g.np
        assert h is not None  # made with the graph
        h[:4, :b] = [
            [s.tokens[0] for s in streams],
            [s.start for s in streams],
            [s.pages[s.start // rows] * rows + s.start % rows for s in streams],
            [s.slot for s in streams],
        ]
        tables = [s.pages for s in streams]
        if need != g.need or tables != g.tables:
            for i, pages in enumerate(tables):
                h[4 : 4 + len(pages), i] = pages
                h[4 + len(pages) : 4 + need, i] = self.scratch_page
            g.tables, g.need = [list(p) for p in tables], need
        if b != g.width:  # columns [b, bucket) are padding again
            self._pad(h, b, g.bucket)
            g.width = b
        dev, host = g.copies.get(need) or g.copies.setdefault(
            need, (g.dev[: 4 + need], g.host[: 4 + need])
        )
        dev.copy_(host, non_blocking=True)
        if g.dev.is_cuda:
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()  # one event, recorded again each round

    def _pad(self, host: "np.ndarray", a: int, b: int) -> None:
        """Columns [a, b): a fresh one-row stream at position 0 on the scratch page and slot."""
        if a < b:
            host[0, a:b] = 0
            host[1, a:b] = 0
            host[2, a:b] = self.scratch_page * self.pool.page_rows
            host[3, a:b] = self.scratch_slot
            host[4:, a:b] = self.scratch_page

    # -- capture ------------------------------------------------------------------------------

    def _build(self, bucket: int) -> _Graph:
        device = self.model.device
        host = torch.empty(4 + self.max_pages, bucket, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        self._pad(host.numpy(), 0, bucket)
        dev = host.to(device)
        if dev.data_ptr() == host.data_ptr():  # on the CPU: the graph's inputs are their own
            dev = host.clone()
        fp = self._static_pass(bucket, dev)
        g = _Graph(bucket, fp, host, dev, np=host.numpy(), width=bucket)
        if self.capture:
            try:
                g.logits, g.graph = self._capture(fp)
            except Exception as exc:  # run this bucket eagerly, and say why
                self.capture_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "CUDA graph capture failed; decode runs eagerly",
                    bucket=bucket,
                    error=self.capture_error,
                )
                torch.cuda.synchronize()
        self.graphs[bucket] = g
        return g

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

    def _static_pass(self, bucket: int, dev: torch.Tensor) -> ForwardPass:
        """A pass of `bucket` one-row streams whose tensors are views of `dev`."""
        rows = self.pool.page_rows
        streams = [
            StreamRows(self.scratch_slot, 0, [0], [self.scratch_page], "last")
            for _ in range(bucket)
        ]
        fp = ForwardPass(streams, rows, self.model.device)
        fp.tokens, fp.positions, fp.write_index = dev[0], dev[1], dev[2]
        ar = torch.arange(bucket, dtype=torch.int64, device=dev.device)
        ones = torch.ones(bucket, dtype=torch.int64, device=dev.device)
        fp.logit_rows = ar
        fp.device_meta = PassMeta(  # type: ignore[attr-defined]
            num_rows=bucket,
            num_streams=bucket,
            num_blocks=bucket,
            row_stream=ar,
            stream_row0=ar,
            stream_len=ones,
            stream_start=dev[1],
            stream_slot=dev[3],
            table=dev[4:].t(),
            block_stream=ar,
            block_row0=ar,
            block_len=ones,
        )
        return fp
