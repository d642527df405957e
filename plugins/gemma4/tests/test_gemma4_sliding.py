"""gemma4's sliding layers on per-stream rings of their last W-1 rows: attention over rings gives
paged attention's bits; a stream far longer than the window gives the same bits however its
passes are cut; the rings tapped mid-pass resume exactly; stale or poisoned ring rows never leak;
the plan counts the rings as fixed bytes a stream; a verify run's rewind puts back plain's rings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pytest
import torch

from tensorfold import testing
from tensorfold.adapters.snapshots import SnapshotArena, snap_keep, snap_restore
from tensorfold.engine.runner import ModelRunner, Stream, open_stream
from tensorfold.family.forward_pass import ForwardPass, StreamRows
from tensorfold.memory.kv_plan import MiB, PlanRefused, plan
from tensorfold.ops.attention import paged_attention
from tensorfold.ops.kv_quant import FP8_DTYPE, index_copy_rows
from tensorfold.ops.window_attention import (
    RingRewinds,
    SavedRingRows,
    advance_rings,
    gather_window,
    window_attention,
)
from tensorfold_gemma4.dummy import CONFIGS
from tensorfold_gemma4.model import shape

if TYPE_CHECKING:
    from conftest import Tiny

LONG = 1400  # many windows, three 512-row pages


def _tokens(vocab: int, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


@pytest.mark.parametrize("window", [1, 2, 8, 100])
def test_window_attention_on_rings_equals_paged_attention_bit_for_bit(window: int) -> None:
    """One stream of 300 rows in uneven passes (GQA 4:2, head_dim 16): the rings start as NaN
    (a poisoned slot) and hold W-1 rows; the pages hold every row."""
    gen = torch.Generator().manual_seed(window)
    n, hq, hkv, d = 300, 4, 2, 16
    q, k, v = (torch.randn(n, h, d, generator=gen) for h in (hq, hkv, hkv))
    flat_k, flat_v = torch.zeros(512, hkv, d), torch.zeros(512, hkv, d)
    ring_k, ring_v = (torch.full((2, window - 1, hkv, d), float("nan")) for _ in "kv")
    for a, b in zip([0, 1, 9, 64, 65, 200, 299], [1, 9, 64, 65, 200, 299, 300]):
        fp = ForwardPass([StreamRows(1, a, [0] * (b - a), [0], "all")], 512)
        flat_k[a:b], flat_v[a:b] = k[a:b], v[a:b]
        paged = paged_attention(q[a:b], flat_k, flat_v, fp, scale=1.0, window=window)
        rows = gather_window(ring_k, ring_v, k[a:b], v[a:b], fp, window)
        assert torch.equal(window_attention(q[a:b], rows, fp, scale=1.0, window=window), paged)
        advance_rings(ring_k, k[a:b], fp)
        advance_rings(ring_v, v[a:b], fp)
    assert ring_k[0].isnan().all()  # slot 0 was never touched


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_ring_rewinds_put_back_each_taps_ring_for_several_streams(dtype: torch.dtype) -> None:
    """RingRewinds over one pass of rewind runs in slots 2 and 0 (rings wrapped; one run as
    long as the ring), a prompt chunk between them, and a rewind run longer than the ring (not
    saved: whole rings): each tap's saved rows, put back into the rings the pass leaves, give
    the ring advanced by the run's rows before the tap alone; e4m3 rings byte for byte."""
    rows, gen = 7, torch.Generator().manual_seed(0)
    ring = torch.randn(4, rows, 2, 4, generator=gen).to(dtype)
    streams = [
        StreamRows(2, 30, [0] * 4, [0], "all", range(31, 34), rewind=True),
        StreamRows(1, 5, [0] * 3, [0], "none"),
        StreamRows(0, 11, [0] * rows, [0], "all", range(12, 18), rewind=True),
        StreamRows(3, 40, [0] * (rows + 1), [0], "all", range(41, 48), rewind=True),
    ]
    fp = ForwardPass(streams, 64)
    new = torch.randn(fp.num_rows, 2, 4, generator=gen).to(dtype)
    rewinds = RingRewinds(fp, rows)
    assert rewinds.streams == [0, 2]
    saved = rewinds.save(ring)
    assert sorted(saved) == [(0, p) for p in range(31, 34)] + [(2, p) for p in range(12, 18)]
    after = ring.clone()
    advance_rings(after, new, fp)
    for (i, p), restore in saved.items():
        run, (a, _) = fp.streams[i], fp.spans[i]
        want = ring[run.slot].clone()
        index_copy_rows(want, torch.arange(run.start, p) % rows, new[a : a + p - run.start])
        got = after[run.slot].clone()
        restore.restore_into(got)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (i, p)


def _passes(
    runner: ModelRunner,
    stream: Stream,
    tokens: list[int],
    cuts: Sequence[int],
    beside: Stream | None = None,
    other: list[int] | None = None,
) -> torch.Tensor:
    """Every row's logits, the stream run in passes [cuts[j], cuts[j+1]); `beside` runs the same
    number of rows of `other` in each of those passes."""
    out = []
    for a, b in zip(cuts, cuts[1:]):
        runs = [stream.rows(tokens[a:b], logits="all")]
        if beside is not None and other is not None:
            runs.append(beside.rows(other[beside.pos : beside.pos + b - a], logits="all"))
        out.append(runner.run(runs)[0])
    return torch.cat(out)


def test_a_stream_far_longer_than_the_window_gives_the_same_bits_however_cut(tiny: "Tiny") -> None:
    windows = {layer.window for layer in tiny.model.cfg.layers if layer.window}
    assert LONG > 10 * max(windows)
    tokens = _tokens(tiny.model.vocab_size, LONG, 3)
    runner = tiny.runner(num_pages=8, num_slots=2)
    whole = _passes(runner, open_stream(runner, 0, LONG), tokens, [0, LONG])
    cuts = [
        [0, 1, 7, 8, 9, 99, 100, 101, 227, 513, 640, 1023, 1024, 1300, 1399, LONG],
        [0, 64, 128, 700, 701, 702, 1100, LONG],
    ]
    for k, at in enumerate(cuts):
        runner = tiny.runner(num_pages=8, num_slots=2)
        stream, beside = open_stream(runner, 1 - k, LONG), open_stream(runner, k, LONG)
        other = _tokens(tiny.model.vocab_size, LONG, 4)
        cut = _passes(runner, stream, tokens, at, beside if k else None, other)
        assert torch.equal(cut, whole), f"cut at {at}"


def _resume(
    runner: ModelRunner, kept_pages: Sequence[int], p: int, slot: int, max_rows: int
) -> Stream:
    """A stream at row p: full layers' rows [0, p) copied from kept pages into its own."""
    stream = open_stream(runner, slot, max_rows)
    rows = runner.pool.page_rows
    table = stream.lease.cover(p)
    for j in range(-(-p // rows)):
        runner.rows.copy_rows(kept_pages[j], table[j], min(rows, p - j * rows))
    stream.pos = p
    return stream


def _poison_outside_window(runner: ModelRunner, slot: int, p: int) -> None:
    """NaN into the ring rows that hold no position of [p - W + 1, p)."""
    for name, ring in runner.slots.buffers.items():
        rows = ring.shape[1]  # W - 1
        valid = {q % rows for q in range(max(0, p - rows), p)}
        stale = [i for i in range(rows) if i not in valid]
        ring[slot, stale] = float("nan")


def test_rings_tapped_mid_pass_resume_as_fresh(tiny: "Tiny") -> None:
    """Marks inside the first pass (one short of a26b_style's window, the others past every
    window), at its end and inside the second. The tapped rings are the rings of a pass cut
    there; restored into a poisoned slot, with NaN in every ring row outside the window, the rest
    of the prompt and 8 decode rows give the fresh run's bits."""
    n, steps, marks = 700, 8, (40, 150, 250, 400, 640)
    tokens = _tokens(tiny.model.vocab_size, n, 5)
    runner = tiny.runner(num_pages=8, num_slots=3)
    fresh = open_stream(runner, 0, n + steps)
    arena = SnapshotArena(tiny.model.layout.fixed, len(marks))
    kept, logits = {}, []
    for a, b in ((0, 400), (400, n)):
        taps = [p for p in marks if a < p <= b]
        pages = list(fresh.lease.cover(b))
        logits.append(runner.run([StreamRows(0, a, tokens[a:b], pages, "all", taps)])[0])
        for p in taps:
            kept[p] = snap_keep(runner.slots, 0, arena, runner.last_pass.tapped[(0, p)])
    fresh.pos = n
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.run([fresh.rows(tokens[-1:], logits="all")])[0])
    want = torch.cat(logits)

    for p in marks:
        cut = tiny.runner(num_slots=1)
        cut.run([open_stream(cut, 0, p).rows(tokens[:p])])
        for spec in tiny.model.layout.fixed:
            assert torch.equal(arena.buffers[spec.name][kept[p].page], cut.slots.get(spec.name)[0])

        runner.slots.poison(1)
        stream = _resume(runner, fresh.lease.pages, p, 1, n + steps)
        assert snap_restore(kept[p], arena, runner.slots, 1)
        _poison_outside_window(runner, 1, p)
        got = [runner.run([stream.rows(tokens[p:n], logits="all")])[0]]
        got += [runner.run([stream.rows([t], logits="all")])[0] for t in tokens[n:]]
        assert torch.equal(torch.cat(got), want[p:]), f"resumed at {p}"
        stream.lease.release()


@pytest.mark.parametrize("reuse", ["poisoned", "stale", "unused"])
def test_stale_and_poisoned_ring_rows_never_leak(tiny: "Tiny", reuse: str) -> None:
    def run(reuse: str) -> torch.Tensor:
        runner = tiny.runner(num_pages=4, num_slots=2, page_rows=64, poison=reuse == "poisoned")
        if reuse != "unused":
            gone = open_stream(runner, 0, 256)
            _passes(runner, gone, _tokens(tiny.model.vocab_size, 230, 6), [0, 200, 230])
            gone.lease.release()
            if reuse == "poisoned":
                runner.slots.poison(0)  # as the lanes do with a freed slot under TF_KV_POISON
        stream = open_stream(runner, 0, 256)
        return _passes(runner, stream, tiny.prompt[:180], [0, 3, 150, 151, 180])

    got = run(reuse)
    assert torch.isfinite(got).all()
    assert torch.equal(got, run("unused"))


def test_the_plan_counts_the_rings_as_fixed_bytes_at_the_26b_shape() -> None:
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "model_type": "gemma4",
        "text_config": CONFIGS["Gemma-4-26B-A4B"],
    }
    layout = shape(config, "bfloat16").layout
    # 5 full layers page K and V of 2 KV heads x 512: 20 KiB a token
    assert len(layout.paged) == 10 and layout.row_bytes == 5 * 2 * 2 * 512 * 2 == 20 * 1024
    # 25 sliding layers keep rings of 1023 rows of K and V, 8 KV heads x 256: 8 KiB a row
    assert len(layout.fixed) == 50 and {s.shape for s in layout.fixed} == {(1023, 8, 256)}
    assert layout.fixed_bytes == 25 * 1023 * 8 * 1024 <= 200 * MiB

    def planned(room: int) -> int:
        return plan(
            room=room,
            page_rows=512,
            page_bytes=layout.page_bytes(512),
            fixed_bytes=layout.fixed_bytes,
            window=8192,
            lanes=8,
            cache_budget=0,
            paging="off",
        ).fixed_bytes

    need = 8 * 16 * layout.page_bytes(512) + 8 * layout.fixed_bytes  # 8 windows of 16 pages
    assert planned(need) == layout.fixed_bytes
    with pytest.raises(PlanRefused):
        planned(need - 1)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_rewound_verify_run_leaves_the_rings_plain_decoding_leaves(
    tiny: "Tiny", kv_dtype: str
) -> None:
    """Verify runs marked rewind (the lanes'), k = 3 accepting 0, 1, 2 and 3 in turn, with rings
    wrapped past W - 1 (e_style: window 8 and KV-sharing layers, a26b_style: window 100): each
    run's taps are saved ring rows, and after each rewind every ring of the slot (and its fp8
    scales) is bit for bit the ring plain one-row decoding leaves there
    (testing.assert_verify_rows_match, which rewinds through runner.rewind_slot)."""

    def make_runner(**sizes: int) -> ModelRunner:
        return ModelRunner(tiny.model, kv_dtype=kv_dtype, **sizes)

    prompt, tokens = tiny.prompt[:104], tiny.prompt[104:116]
    rounds = testing.assert_verify_rows_match(
        make_runner, prompt, tokens, 3, page_rows=64, accepted=(0, 1, 2, 3), rewind=True
    )
    assert rounds >= 4


def test_a_verify_run_taps_saved_ring_rows_unless_longer_than_the_ring(tiny: "Tiny") -> None:
    """A rewind run taps, a ring a tap, the rows of the positions at and past the tap as they
    stood before the pass (a row a draft, not a ring); a run longer than a ring (two of its
    positions on one ring row) and a run not marked rewind tap whole rings."""
    prompt = tiny.prompt[:104]
    windows = {layer.window for layer in tiny.model.cfg.layers if layer.window}
    for n, rewind in ((4, True), (4, False), (max(windows), True)):
        runner = tiny.runner(num_pages=2, num_slots=1, page_rows=128)
        stream = open_stream(runner, 0, 256)
        runner.run([stream.rows(prompt)])
        tokens = tiny.prompt[104 : 104 + n]
        taps = range(104 + 1, 104 + n)
        pages = list(stream.lease.cover(104 + n))
        runner.run([StreamRows(0, 104, tokens, pages, "all", taps, rewind=rewind)])
        assert runner.last_pass is not None
        for p in taps:
            for name, state in runner.last_pass.tapped[(0, p)].items():
                ring_rows = runner.slots.get(name).shape[1]
                if rewind and n <= ring_rows:
                    assert isinstance(state, SavedRingRows)
                    assert state.index.tolist() == [q % ring_rows for q in range(p, 104 + n)]
                else:
                    assert isinstance(state, torch.Tensor) and state.shape[0] == ring_rows
