"""Exactness of glm5_next across passes: a stream's logits are bit-identical whether it runs
alone or beside other streams, on contiguous or shuffled pages, in a fresh slot or a reused one,
with freed pages poisoned or not; states tapped mid-pass equal the states a cut pass leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pytest
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.forward_pass import StreamRows
from tensorfold.runner import ModelRunner, Stream, open_stream
from tensorfold_glm.model import GlmModel, load

if TYPE_CHECKING:
    from conftest import Tiny


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (200, 250, 37)]


def _prepare(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[Stream], list]:
    """Stream 0 has prefilled its prompt (next: a decode row), stream 1 the first 100 rows of its
    prompt (next: a chunk from row 100), stream 2 nothing (next: a fresh prompt). Each ran alone."""
    streams = [open_stream(runner, slot, 600) for slot in range(3)]
    (logits,) = runner.run([streams[0].rows(prompts[0])])
    runner.run([streams[1].rows(prompts[1][:100])])
    decode = int(logits[-1].argmax())
    nexts = [([decode], "all"), (prompts[1][100:], "all"), (prompts[2], "all")]
    return streams, nexts


def _model(tiny: "Tiny", dtype: str) -> GlmModel:
    return tiny.model if dtype == "float32" else load(Checkpoint.open(tiny.path), "cpu", dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("together", [(0, 1), (1, 2), (0, 1, 2)])
def test_streams_in_one_pass_equal_streams_alone(
    tiny: "Tiny", dtype: str, together: Sequence[int]
) -> None:
    model = _model(tiny, dtype)
    prompts = _prompts()
    solo_runner = tiny.runner(model=model, num_pages=6, num_slots=3)
    solo_streams, nexts = _prepare(solo_runner, prompts)
    alone = {i: solo_runner.run([solo_streams[i].rows(*nexts[i])])[0] for i in together}

    joint_runner = tiny.runner(model=model, num_pages=6, num_slots=3)
    joint_streams, nexts = _prepare(joint_runner, prompts)
    joint = joint_runner.run([joint_streams[i].rows(*nexts[i]) for i in together])
    for i, logits in zip(together, joint):
        assert torch.equal(logits, alone[i]), f"stream {i} changed beside streams {together}"


def _run_on_pages(model: GlmModel, tokens: list[int], pages: list[int], page_rows: int,
                  cuts: Sequence[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=max(pages) + 1, num_slots=1, page_rows=page_rows)
    out = [
        runner.run([StreamRows(0, a, tokens[a:b], pages, "all")])[0]
        for a, b in zip(cuts, cuts[1:])
    ]
    return torch.cat(out)


def test_shuffled_page_table_gives_identical_logits(tiny: "Tiny") -> None:
    tokens = tiny.prompt[:400] + [5, 9, 11]
    n = len(tokens)
    cuts = [0, 150, 400, n - 2, n - 1, n]  # a prompt in two chunks, then decodes
    contiguous = _run_on_pages(tiny.model, tokens, [0], 512, cuts)
    gen = torch.Generator().manual_seed(5)
    rows = 32
    table = torch.randperm(64, generator=gen)[: -(-n // rows)].tolist()
    assert table != sorted(table)
    shuffled = _run_on_pages(tiny.model, tokens, table, rows, cuts)
    assert torch.equal(shuffled, contiguous)


def test_reused_slot_starts_from_zero_state(tiny: "Tiny") -> None:
    runner = tiny.runner(num_slots=1)
    other = open_stream(runner, 0, 100)
    runner.run([other.rows(list(range(3, 90)))])  # leaves its KDA states in slot 0
    other.lease.release()
    stream = open_stream(runner, 0, 100)
    (reused,) = runner.run([stream.rows(tiny.prompt[:64], logits="all")])

    fresh_runner = tiny.runner(num_slots=1)
    fresh = open_stream(fresh_runner, 0, 100)
    (clean,) = fresh_runner.run([fresh.rows(tiny.prompt[:64], logits="all")])
    assert torch.equal(reused, clean)


def test_poisoned_free_pages_change_nothing(tiny: "Tiny") -> None:
    def run(poison: bool) -> torch.Tensor:
        runner = tiny.runner(num_pages=4, num_slots=2, page_rows=64, poison=poison)
        gone = open_stream(runner, 1, 256)
        runner.run([gone.rows(list(range(3, 200)))])
        gone.lease.release()  # its pages are freed (and NaN-filled when poisoned)
        stream = open_stream(runner, 0, 256)
        (a,) = runner.run([stream.rows(tiny.prompt[:150], logits="all")])
        (b,) = runner.run([stream.rows(tiny.prompt[150:151], logits="all")])
        return torch.cat([a, b])

    poisoned = run(True)
    assert torch.isfinite(poisoned).all()
    assert torch.equal(poisoned, run(False))


def test_taps_inside_a_pass_equal_the_state_a_cut_leaves(tiny: "Tiny") -> None:
    """A keep at row p taps the state the pass computes there: the same bits as the slots hold
    after a pass that ends at p."""
    taps = [37, 64, 201]
    runner = tiny.runner(num_slots=1)
    runner.run([StreamRows(0, 0, tiny.prompt[:300], list(range(8)), "none", taps)])
    tapped = runner.last_pass.tapped
    names = {s.name for s in tiny.model.layout.fixed}
    for p in taps:
        assert set(tapped[(0, p)]) == names
        cut = tiny.runner(num_slots=1)
        cut.run([StreamRows(0, 0, tiny.prompt[:p], list(range(8)), "none")])
        for name in names:
            assert torch.equal(tapped[(0, p)][name], cut.slots.get(name)[0]), (p, name)
