"""The target's K/V an assistant step reads (assistant.py), gathered from the engine's storage.

For a stream at position p (rows [0, p) written, its next token not yet fed), from the target's
store layer of each kind (`assistant.store_layers`):
- full: the paged rows `L{i}.k` / `L{i}.v` [pages * R, Hkv, D] (adapters/paged_kv.py), rows
  [0, p) through the stream's page table (row q at flat row pages[q // R] * R + q % R, as
  ForwardPass.read_index indexes them);
- sliding (window W): the ring `L{i}.sk` / `L{i}.sv` [slots, W-1, Hkv, D] (sliding.py), rows
  [max(0, p - W + 1), p) at ring index q mod (W - 1).
fp8 rows and rings (TF_KV_DTYPE=fp8) come back dequantized (times their scales) in the model
dtype. The copies are [Hkv, p, D] for the full layer (p rows: the cost grows with the context,
see plugins/gemma4/README.md) and [Hkv, <= W-1, D] for the sliding one.

A ring holds W - 1 rows, the assistant reads the last W + 1 sliding rows transformers gives it:
past W - 1 rows of context the rings' drafts read two rows fewer than transformers' (drafts
only: verification keeps the output exact whatever the assistant proposes).

Read after the pass that wrote row p - 1 (and after a verify round's rollback), before the next
pass advances the rings. One rank's heads under tensor parallel: refused there for now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from tensorfold.memory.kv_dtype import SCALE

from .assistant import KVRows, store_layers
from .config import SLIDING

if TYPE_CHECKING:
    from tensorfold.adapters.paged_kv import PagedRows
    from tensorfold.adapters.stream_state import StreamSlots

    from .model import Gemma4Model


def gather_shared_kv(
    model: "Gemma4Model",
    rows: "PagedRows",
    slots: "StreamSlots",
    streams: Sequence[tuple[int, Sequence[int], int]],
) -> dict[str, KVRows]:
    """streams: (slot, page table, p) each -> {layer kind: KVRows}, keys/values
    [B, Hkv, T, D] in the model dtype, stream b's rows [0, lengths[b]) valid (zero padding)."""
    if model.tp.world > 1:
        raise ValueError("gather_shared_kv reads one rank's KV heads; run it at one rank")
    out = {}
    for kind, index in store_layers(model.cfg).items():
        layer = model.cfg.layers[index]
        got = [
            _ring_rows(slots, index, slot, p, layer.window)
            if kind == SLIDING and layer.window is not None
            else _paged_rows(rows, index, pages, p)
            for slot, pages, p in streams
        ]
        lengths = [k.shape[0] for k, _ in got]
        keys, values = (_stack([pair[j] for pair in got], model.dtype) for j in (0, 1))
        out[kind] = KVRows(keys, values, lengths)
    return out


def _paged_rows(
    rows: "PagedRows", layer: int, pages: Sequence[int], p: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [0, p) of full layer `layer`'s K and V: [p, Hkv, D] each."""
    r = rows.page_rows
    dev = rows.flat(f"L{layer}.k").device
    pos = torch.arange(p, device=dev)
    table = torch.tensor(list(pages), dtype=torch.long, device=dev)
    index = table[pos // r] * r + pos % r
    k, v = (
        _dequantized(rows.flat(name).index_select(0, index), rows.scales(name), index)
        for name in (f"L{layer}.k", f"L{layer}.v")
    )
    return k, v


def _ring_rows(
    slots: "StreamSlots", layer: int, slot: int, p: int, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [max(0, p - W + 1), p) of sliding layer `layer`'s rings: [<= W-1, Hkv, D] each."""
    ring_k = slots.get(f"L{layer}.sk")
    size = max(ring_k.shape[1], 1)
    index = torch.arange(max(0, p - window + 1), p, device=ring_k.device) % size
    out = []
    for name in (f"L{layer}.sk", f"L{layer}.sv"):
        scales = slots.buffers.get(name + SCALE)
        ring = slots.get(name)[slot]
        out.append(_dequantized(ring.index_select(0, index), _slot(scales, slot), index))
    return out[0], out[1]


def _slot(scales: torch.Tensor | None, slot: int) -> torch.Tensor | None:
    return None if scales is None else scales[slot]


def _dequantized(
    got: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor
) -> torch.Tensor:
    """Rows as read, or fp8 rows times their scales (`scales` indexed as the rows were), fp32."""
    if scales is None:
        return got
    return got.float() * scales.index_select(0, index)


def _stack(per_stream: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """[T_b, Hkv, D] each -> [B, Hkv, max T_b, D] in `dtype`, zero-padded at the end."""
    longest = max(t.shape[0] for t in per_stream)
    first = per_stream[0]
    shape = (len(per_stream), first.shape[1], longest, first.shape[2])
    out = torch.zeros(shape, dtype=dtype, device=first.device)
    for b, t in enumerate(per_stream):
        out[b, :, : t.shape[0]] = t.transpose(0, 1).to(dtype)
    return out
