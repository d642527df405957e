"""Runs passes of a family's model over the pool: the storage behind pages and slots.

Everything the lanes and the prompt store do to that storage goes through a runner method
(a pass, a slot's poison, a resume's page copy and snapshot restore, a keep), so that under
tensor parallel rank 0's runner can repeat each one on the other ranks
(`tensorfold.engine.tensor_parallel.Leader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tensorfold.adapters import paged_kv
from tensorfold.adapters.paged_kv import PagedRows
from tensorfold.adapters.stream_state import StreamSlots

from ..family.forward_pass import ForwardPass, LogitRows, StreamRows
from ..family.media import MediaPiece
from ..family.model import FamilyModel
from ..memory.kv_dtype import kv_layout
from ..memory.kv_pool import KVPool, Lease
from ..ops import parallel
from .cpu_threads import one_cpu_thread


class ModelRunner:
    """A model, its pool of pages, the storage behind them, and a fixed-state slot a lane."""

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
    ):
        self.model = model
        self.pool = KVPool(num_pages, page_rows, poison=poison)
        device = str(model.device)
        # the layout as stored: under kv_dtype "fp8" the family's fp8 rows and their scales
        self.layout = stored = kv_layout(
            model.layout, kv_dtype, getattr(model, "name", "the family")
        )
        rows = None
        if plugin_manager is not None:
            rows = plugin_manager.hook.share_pool(
                layout=stored, num_pages=num_pages, page_rows=page_rows, device=device
            )
        self.rows: PagedRows = rows or paged_kv.share_pool(stored, num_pages, page_rows, device)
        self.slots = StreamSlots(stored.fixed, num_slots, device)
        if poison:
            self.pool.on_freed.append(self.rows.poison)
        self.last_pass: ForwardPass | None = None

    @torch.inference_mode()
    def run(self, streams: Sequence[StreamRows]) -> list[torch.Tensor]:
        """One pass; returns each stream's logits ([rows wanted, vocab], fp32)."""
        return self._run(ForwardPass(streams, self.pool.page_rows, self.model.device))

    @torch.inference_mode()
    def run_fed(self, streams: Sequence[StreamRows], tokens: torch.Tensor) -> list[torch.Tensor]:
        """A pass of one decode row a stream whose tokens are already on the model's device
        (`tokens` [len(streams)] int64, in the streams' order; the streams' own token lists
        are placeholders): a round the host sends before it has read the last round's draws."""
        fp = ForwardPass(streams, self.pool.page_rows, self.model.device)
        assert fp.num_rows == len(streams) == tokens.shape[0], "one decode row a stream"
        fp.tokens = tokens
        return self._run(fp)

    def _run(self, fp: ForwardPass) -> list[torch.Tensor]:
        if torch.device(self.model.device).type == "cpu":
            with one_cpu_thread():
                logits = self.forward(fp)
        else:
            logits = self.forward(fp)
        self.last_pass = fp  # its taps feed the prompt store's keeps
        return fp.split_logits(logits)

    @torch.inference_mode()
    def encode_media(self, pieces: Sequence[MediaPiece]) -> list[torch.Tensor]:
        """The pieces' row embeddings ([piece.rows, hidden] each), from the family's tower
        (`FamilyModel.encode_media`), for a prompt chunk that holds their rows. Under tensor
        parallel only rank 0 runs it; the pass sends the rows to the others."""
        if torch.device(self.model.device).type == "cpu":
            with one_cpu_thread():
                out = self.model.encode_media(pieces)
        else:
            out = self.model.encode_media(pieces)
        if len(out) != len(pieces) or any(
            v.dim() != 2 or v.shape[0] != m.rows for v, m in zip(out, pieces)
        ):
            got = [tuple(v.shape) for v in out]
            raise ValueError(
                f"encode_media gave {got} for pieces of {[m.rows for m in pieces]} rows: "
                "one [rows, hidden] a piece"
            )
        return out

    def verify_row_counts(self, streams: int) -> tuple[int, ...]:
        """Rows a stream (k + 1) of the verify passes of `streams` streams that run faster when
        every stream in the pass has the same count (a GraphRunner's graphs), smallest first;
        () when none do."""
        return ()

    def forward(self, fp: ForwardPass) -> torch.Tensor:
        """The model's forward over `fp`, its collectives' pass fence first (ops.parallel)."""
        parallel.begin_pass()
        return self.model.forward(fp, self.rows, self.slots)

    def poison_slot(self, slot: int) -> None:
        """Fill a freed slot's fixed state with NaN (TF_KV_POISON)."""
        self.slots.poison(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """A forked choice's fixed state: slot src's, copied into slot dst (n > 1)."""
        self.slots.copy(src, dst)

    def rewind_slot(self, slot: int, tap: tuple[int, int]) -> None:
        """A verify round's rejected drafts undone in the fixed state: the slot takes the state
        the last pass tapped at `tap` = (stream index in the pass, position), every buffer: a
        tapped tensor is copied in, a `SlotRestore` (a `rewind` run's cheaper tap) restores
        the slot's buffer in place. Call it right after that pass, for the slot its stream
        ran in."""
        assert self.last_pass is not None
        tapped = self.last_pass.taps_at(*tap) or {}
        missing = sorted(set(self.slots.buffers) - set(tapped))
        if missing:
            raise RuntimeError(
                f"the family tapped no {', '.join(missing)} at position {tap[1]}: a verify run "
                "must tap every fixed state at each draft row"
            )
        for name, state in tapped.items():
            if isinstance(state, torch.Tensor):
                self.slots.get(name)[slot].copy_(state)
            else:
                state.restore_into(self.slots.get(name)[slot])

    def attach(self, hooks: Any, lease: Lease, kept_pages: list[int], kept_rows: int) -> list[int]:
        """A resumed stream's page table from the store's pages (the share_attach hook)."""
        return hooks.share_attach(
            lease=lease, rows=self.rows, kept_pages=kept_pages, kept_rows=kept_rows
        )

    def keep_state(self, hooks: Any, arena: Any, slot: int, tap: tuple[int, int] | None) -> Any:
        """Keep a slot's fixed state in the arena (the snap_keep hook): as the last pass tapped it
        at `tap` = (stream index in the pass, position), or as it stands when that pass tapped
        nothing there (or tap is None). Returns the snapshot, or None."""
        taps = None
        if tap is not None and self.last_pass is not None:
            taps = self.last_pass.taps_at(*tap)
        if taps is not None and not all(isinstance(t, torch.Tensor) for t in taps.values()):
            raise RuntimeError(f"the taps at {tap} are a rewind run's: the prompt store keeps none")
        return hooks.snap_keep(slots=self.slots, slot=slot, arena=arena, taps=taps)

    def restore_state(self, hooks: Any, arena: Any, snapshot: Any, slot: int) -> bool:
        """Copy a kept snapshot back into a slot (the snap_restore hook)."""
        return bool(hooks.snap_restore(snapshot=snapshot, arena=arena, slots=self.slots, slot=slot))


@dataclass
class Stream:
    """A stream driven directly (tests, tools): its slot, its lease and how far it has run."""

    slot: int
    lease: Lease
    pos: int = 0

    def rows(self, tokens: Sequence[int], logits: LogitRows = "last") -> StreamRows:
        """The next run of rows; takes the pages they need from the lease."""
        pages = self.lease.cover(self.pos + len(tokens))
        run = StreamRows(self.slot, self.pos, list(tokens), list(pages), logits)
        self.pos += len(tokens)
        return run


def open_stream(runner: ModelRunner, slot: int, max_rows: int) -> Stream:
    return Stream(slot, runner.pool.lease(max_rows))
