"""The kernels path's KDA launches (kda_launches.py): a prompt's whole 64-row chunks through the
chunked kernel, the other rows through the recurrent one. Under the interpreter on the CPU the
chunked rows run the stand-in (fp64, rounded back), whose bits differ from the recurrent rows',
so a row sent to the wrong kernel changes the bits these tests compare."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="the kernels path needs triton")

from tensorfold.engine.lanes import Lanes  # noqa: E402
from tensorfold.engine.requests import Request, TokenOut  # noqa: E402
from tensorfold.engine.runner import ModelRunner, open_stream  # noqa: E402
from tensorfold.engine.sampling import SamplingParams  # noqa: E402
from tensorfold.family.forward_pass import ForwardPass, StreamRows  # noqa: E402
from tensorfold_glm.kda_launches import Segments, segments, tap_cuts  # noqa: E402

TOKENS = [(7 * i + 3) % 90 + 3 for i in range(400)]


@pytest.mark.parametrize(
    "start, n, taps, want",
    [
        (0, 150, [], Segments((0, 0), ((0, 128),), (128, 150))),
        (0, 150, [64], Segments((0, 0), ((0, 64), (64, 128)), (128, 150))),
        (0, 128, [128], Segments((0, 0), ((0, 128),), (128, 128))),
        (3000, 1, [], Segments((0, 1), (), (1, 1))),  # a decode row
        (64, 1, [], Segments((0, 0), (), (0, 1))),  # a decode row on a boundary
        (10, 200, [], Segments((0, 54), ((54, 182),), (182, 200))),
        (0, 40, [], Segments((0, 0), (), (0, 40))),  # a prompt shorter than a chunk
    ],
)
def test_segments(start, n, taps, want):
    assert segments(start, n, taps) == want


def _run(runner, stream, tokens, logits="all"):
    return runner.run([stream.rows(tokens, logits)])[0]


def test_the_chunked_rows_take_the_other_kernel(kernels_on_cpu, kda_model):
    """In fp32 the chunk stand-in's rows differ from the recurrence's, so the tests below can
    fail; the rows past the last chunk boundary are the recurrence's own."""
    from tensorfold.ops import gpu

    model = kda_model(torch.float32)
    runner = ModelRunner(model, num_pages=8, num_slots=1, page_rows=64)
    got = _run(runner, open_stream(runner, 0, 256), TOKENS[:132])
    gpu.set_triton(False)
    runner = ModelRunner(model, num_pages=8, num_slots=1, page_rows=64)
    want = _run(runner, open_stream(runner, 0, 256), TOKENS[:132])
    assert not torch.equal(got[:128], want[:128])
    assert (got - want).abs().max() < 1e-4


def test_a_prompt_cut_at_chunk_boundaries_equals_one_pass(kernels_on_cpu, kda_model, own_recurrent):
    """Rows, the decode after, and the state: the same bits whether the prompt came in one pass
    or in passes cut at 64 and 128."""
    model = kda_model(torch.bfloat16)

    def run(cuts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        runner = ModelRunner(model, num_pages=8, num_slots=1, page_rows=64)
        stream = open_stream(runner, 0, 256)
        bounds = [0, *cuts, 130]  # 2 rows past the last boundary: a recurrent run of several
        rows = [_run(runner, stream, TOKENS[a:b]) for a, b in zip(bounds, bounds[1:])]
        rows.append(_run(runner, stream, [int(rows[-1][-1].argmax())]))
        return torch.cat(rows), runner.slots.get("L0.kda")[0].clone()

    (whole, s1), (cut, s2) = run([]), run([64, 128])
    assert torch.equal(whole, cut) and torch.equal(s1, s2)


def test_taps_inside_a_pass_equal_passes_ending_there(kernels_on_cpu, kda_model, own_recurrent):
    model = kda_model(torch.bfloat16)
    runner = ModelRunner(model, num_pages=8, num_slots=1, page_rows=64)
    pages = open_stream(runner, 0, 256).lease.cover(130)
    runner.run([StreamRows(0, 0, TOKENS[:130], list(pages), "last", [64, 128])])
    tapped = runner.last_pass.tapped
    # passes ending at 64 and at 128 (the second resumed at 64: a prompt cut at chunk
    # boundaries leaves one pass's state, test_a_prompt_cut_at_chunk_boundaries_equals_one_pass)
    alone = ModelRunner(model, num_pages=8, num_slots=1, page_rows=64)
    stream = open_stream(alone, 0, 256)
    for a, p in ((0, 64), (64, 128)):
        _run(alone, stream, TOKENS[a:p], "last")
        assert torch.equal(tapped[(0, p)]["L0.kda"], alone.slots.get("L0.kda")[0]), p
        assert torch.equal(tapped[(0, p)]["L0.conv"], alone.slots.get("L0.conv")[0]), p


def test_the_lanes_cut_a_prompt_on_the_chunk_grid(kernels_on_cpu, kda_model):
    """With a row budget a stream's prompt is cut at multiples of mark_rows (64), and its tokens
    equal its tokens alone, whose passes cut it elsewhere."""
    model = kda_model(torch.bfloat16)
    runs: list[tuple[int, int, int]] = []

    def tokens(prompts: list[list[int]]) -> list[list[int]]:
        runner = ModelRunner(model, num_pages=24, num_slots=2, page_rows=64)
        plain_run = runner.run

        def run(streams, *a, **k):
            runs.extend((s.slot, s.start, s.start + len(s.tokens)) for s in streams)
            return plain_run(streams, *a, **k)

        runner.run = run
        lanes = Lanes(runner, lanes=2, window=512, pass_rows=128)
        out: list[list[int]] = [[] for _ in prompts]
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=3).with_seed()
        for i, p in enumerate(prompts):
            lanes.add(
                Request(
                    list(p),
                    params,
                    lambda e, got=out[i]: isinstance(e, TokenOut) and got.append(e.token),
                )
            )
        while lanes.step():
            pass
        return out

    together = tokens([TOKENS[:40], TOKENS[40:172]])
    prompt_runs = [r for r in runs if r[0] == 1 and r[2] - r[1] > 1]
    assert prompt_runs[:3] == [(1, 0, 64), (1, 64, 128), (1, 128, 132)]
    assert together[1] == tokens([TOKENS[40:172]])[0]


@pytest.mark.parametrize(
    "rows, start, taps, want",
    [
        ((0, 0), 60, [61], []),
        ((0, 4), 60, [], [(0, 4)]),
        ((0, 4), 60, [61, 62, 63], [(0, 1), (1, 2), (2, 3), (3, 4)]),
        ((0, 4), 60, [60, 64, 70], [(0, 4)]),  # only taps inside the rows cut them
        ((4, 8), 60, [61, 62, 63, 64, 65, 66, 67], [(4, 5), (5, 6), (6, 7), (7, 8)]),
    ],
)
def test_tap_cuts(rows, start, taps, want):
    assert tap_cuts(rows, start, taps) == want


def test_delta_rule_pass_taps_each_draft_row_as_one_row_passes_leave_it(
    kernels_on_cpu, kda_model, own_recurrent
):
    """delta_rule_pass alone: a decode row, an 8-row verify run from row 60 (across the chunk
    boundary, taps at 61..67) and a 5-row chunk in one pass give the verify run's rows and taps
    the bits of one-row passes, and leave the others' states as passes of their own do."""
    from tensorfold_glm.kda_launches import TorchKernels, delta_rule_pass
    from tensorfold_glm.ops import sigmoid

    model = kda_model(torch.float32)
    kernels = TorchKernels(model.cfg, model.weights.layers[0].mixer, 2)
    gen = torch.Generator().manual_seed(0)
    runs = [(0, 100, 1, ()), (1, 60, 8, range(61, 68)), (2, 30, 5, ())]  # slot, start, rows, taps
    n = sum(rows for _, _, rows, _ in runs)
    q, k, v, pre = (torch.randn(n, 32, generator=gen) for _ in range(4))
    b = torch.randn(n, 2, generator=gen)
    start_states = torch.randn(3, 2, 16, 16, generator=gen)

    def one_pass(streams, rows):
        fp = ForwardPass(streams, 512)
        got = delta_rule_pass(
            kernels, *(t[rows] for t in (q, k, v, pre, b)), sigmoid(b[rows]), states, fp, "s"
        )
        return got, fp.tapped

    states = start_states.clone()
    out, tapped = one_pass(
        [StreamRows(slot, at, [0] * rows, [0], "all", taps) for slot, at, rows, taps in runs],
        torch.arange(n),
    )
    joint = states.clone()
    states = start_states.clone()
    for (slot, at, rows, _), lo in zip(runs, (0, 1, 9)):
        for r in range(rows):  # one row a pass
            row, _ = one_pass([StreamRows(slot, at + r, [0], [0])], torch.tensor([lo + r]))
            assert torch.equal(row, out[lo + r : lo + r + 1]), (slot, r)
            if slot == 1 and r < rows - 1:
                assert torch.equal(tapped[(1, at + r + 1)]["s"], states[1]), r
    assert torch.equal(joint, states)


def test_a_verify_run_across_a_chunk_boundary_taps_every_draft_row(kernels_on_cpu, kda_model):
    """A stream's token and 3 drafts as one run (taps at every draft row) beside a decode row
    and a prompt chunk, from row 62: the first run crosses the 64-row chunk boundary (all its
    rows recurrent, as plain decoding's) and a 21-row page's; each row and each tap equal plain
    decoding's, rounds rejecting drafts in turn (testing.assert_verify_rows_match)."""
    from tensorfold import testing

    model = kda_model(torch.bfloat16)
    rounds = testing.assert_verify_rows_match(
        testing.runner_factory(model), TOKENS[:62], TOKENS[62:68], 3, page_rows=21
    )
    assert rounds == 3
