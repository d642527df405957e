"""A pass's layout as device tensors, for kernels that work on the whole pass at once.

Built once per ForwardPass from its streams (one host-to-device copy) and cached on it. A CUDA
graph runner presets it to static buffers instead (core/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..family.forward_pass import ForwardPass

QUERY_ROWS = 16  # query rows of one stream in an attention program
_ALIGN_INTS = 4  # int32s in 16 bytes


@dataclass
class PassMeta:
    num_rows: int
    num_streams: int
    num_blocks: int
    row_stream: torch.Tensor  # [N] int32: the stream each row belongs to
    stream_row0: torch.Tensor  # [S] int32: the stream's first row in the pass
    stream_len: torch.Tensor  # [S] int32: its rows in the pass
    stream_start: torch.Tensor  # [S] int32: absolute position of its first row
    stream_slot: torch.Tensor  # [S] int32: its fixed-state slot
    table: torch.Tensor  # [S, max_pages] int32: page tables (any strides)
    block_stream: torch.Tensor  # [B] int32: attention query blocks: stream,
    block_row0: torch.Tensor  # [B] int32: first row,
    block_len: torch.Tensor  # [B] int32: rows (1..QUERY_ROWS)


def pass_meta(fp: ForwardPass) -> PassMeta:
    meta = getattr(fp, "device_meta", None)
    if meta is None:
        meta = build_meta(fp)
        fp.device_meta = meta  # type: ignore[attr-defined]
    return meta


def build_meta(fp: ForwardPass) -> PassMeta:
    streams, spans = fp.streams, fp.spans
    s = len(streams)
    max_pages = max(len(st.pages) for st in streams)
    row_stream: list[int] = []
    blocks: list[tuple[int, int, int]] = []
    for i, (a, b) in enumerate(spans):
        row_stream.extend([i] * (b - a))
        blocks.extend((i, r, min(QUERY_ROWS, b - r)) for r in range(a, b, QUERY_ROWS))
    table = [p for st in streams for p in [*st.pages, *[0] * (max_pages - len(st.pages))]]
    sections = [
        row_stream,
        [a for a, _ in spans],
        [b - a for a, b in spans],
        [st.start for st in streams],
        [st.slot for st in streams],
        *([blk[kind] for blk in blocks] for kind in range(3)),
        table,
    ]
    # Each section starts at a multiple of 16 bytes: Triton specialises a pointer on 16-byte
    # alignment, so views at the sections' raw offsets (which follow the pass's row, stream and
    # block counts) made a pass of a new shape compile its kernels again (~1 s, mid-serving)
    flat: list[int] = []
    sizes = []
    for sec in sections:
        pad = -len(sec) % _ALIGN_INTS
        flat.extend(sec)
        flat.extend([0] * pad)
        sizes += [len(sec), pad]
    dev = torch.tensor(flat, dtype=torch.int32).to(fp.device, non_blocking=True)
    n, nb = fp.num_rows, len(blocks)
    parts = torch.split(dev, sizes)[::2]
    return PassMeta(
        n,
        s,
        nb,
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        parts[4],
        parts[8].view(s, max_pages),
        parts[5],
        parts[6],
        parts[7],
    )
