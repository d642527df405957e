"""A pass's device layout (ops/pass_meta.py): what each view holds, and that every view starts
16-byte aligned whatever the pass's row, stream and block counts (Triton compiles a kernel
again for a pointer of another alignment, so a misaligned view cost a compile mid-serving)."""

from __future__ import annotations

import pytest

from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.ops.pass_meta import QUERY_ROWS, build_meta

TENSORS = (
    "row_stream",
    "stream_row0",
    "stream_len",
    "stream_start",
    "stream_slot",
    "table",
    "block_stream",
    "block_row0",
    "block_len",
)


@pytest.mark.parametrize(
    "specs",
    [
        [(0, 2115, 33)],  # a chat's next turn: 33 rows after a 2115-row prefix
        [(1, 0, 40), (2, 0, 7)],  # two packed prompts
        [(0, 900, 1), (3, 17, 1), (4, 5000, 1)],  # decode rows
        [(2, 0, 300)],
    ],
)
def test_every_view_is_aligned_and_holds_the_pass(specs):
    page_rows = 64
    streams, used = [], 0
    for slot, start, n in specs:
        k = -(-(start + n) // page_rows)
        streams.append(StreamRows(slot, start, [0] * n, list(range(used, used + k))))
        used += k
    fp = ForwardPass(streams, page_rows)
    meta = build_meta(fp)
    for name in TENSORS:
        assert getattr(meta, name).data_ptr() % 16 == 0, name
    spans = fp.spans
    assert meta.row_stream.tolist() == [i for i, (a, b) in enumerate(spans) for _ in range(a, b)]
    assert meta.stream_row0.tolist() == [a for a, _ in spans]
    assert meta.stream_len.tolist() == [b - a for a, b in spans]
    assert meta.stream_start.tolist() == [s.start for s in streams]
    assert meta.stream_slot.tolist() == [s.slot for s in streams]
    width = max(len(s.pages) for s in streams)
    assert meta.table.tolist() == [list(s.pages) + [0] * (width - len(s.pages)) for s in streams]
    blocks = [
        (i, r, min(QUERY_ROWS, b - r))
        for i, (a, b) in enumerate(spans)
        for r in range(a, b, QUERY_ROWS)
    ]
    assert meta.num_blocks == len(blocks)
    assert meta.block_stream.tolist() == [b[0] for b in blocks]
    assert meta.block_row0.tolist() == [b[1] for b in blocks]
    assert meta.block_len.tolist() == [b[2] for b in blocks]
