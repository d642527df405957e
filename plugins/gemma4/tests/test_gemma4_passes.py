"""Exactness of gemma4 across passes: a stream's logits are bit-identical whether it runs alone or
beside other streams, on contiguous or shuffled pages, with freed pages poisoned or not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pytest
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.forward_pass import StreamRows
from tensorfold.runner import ModelRunner, Stream, open_stream
from tensorfold_gemma4.model import Gemma4Model, load

if TYPE_CHECKING:
    from conftest import Tiny


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (180, 230, 37)]


def _prepare(runner: ModelRunner, prompts: list[list[int]]) -> tuple[list[Stream], list]:
    """Stream 0 has prefilled its prompt (next: a decode row), stream 1 the first 100 rows of its
    prompt (next: a chunk from row 100), stream 2 nothing (next: a fresh prompt). Each ran alone."""
    streams = [open_stream(runner, slot, 300) for slot in range(3)]
    (logits,) = runner.run([streams[0].rows(prompts[0])])
    runner.run([streams[1].rows(prompts[1][:100])])
    decode = int(logits[-1].argmax())
    nexts = [([decode], "all"), (prompts[1][100:], "all"), (prompts[2], "all")]
    return streams, nexts


def _model(tiny: "Tiny", dtype: str) -> Gemma4Model:
    return tiny.model if dtype == "float32" else load(Checkpoint.open(tiny.path), "cpu", dtype)


@pytest.mark.parametrize(
    "dtype, together",
    [("float32", (0, 1)), ("float32", (0, 1, 2)), ("bfloat16", (0, 1, 2))],
)
def test_streams_in_one_pass_equal_streams_alone(
    tiny: "Tiny", dtype: str, together: Sequence[int]
) -> None:
    model = _model(tiny, dtype)
    prompts = _prompts(model.vocab_size)
    solo_runner = tiny.runner(model=model, num_pages=3, num_slots=3)
    solo_streams, nexts = _prepare(solo_runner, prompts)
    alone = {i: solo_runner.run([solo_streams[i].rows(*nexts[i])])[0] for i in together}

    joint_runner = tiny.runner(model=model, num_pages=3, num_slots=3)
    joint_streams, nexts = _prepare(joint_runner, prompts)
    joint = joint_runner.run([joint_streams[i].rows(*nexts[i]) for i in together])
    for i, logits in zip(together, joint):
        assert torch.equal(logits, alone[i]), f"stream {i} changed beside streams {together}"


def _run_on_pages(model: Gemma4Model, tokens: list[int], pages: list[int], page_rows: int,
                  cuts: Sequence[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=max(pages) + 1, num_slots=1, page_rows=page_rows)
    out = [
        runner.run([StreamRows(0, a, tokens[a:b], pages, "all")])[0]
        for a, b in zip(cuts, cuts[1:])
    ]
    return torch.cat(out)


def test_shuffled_page_table_gives_identical_logits(tiny: "Tiny") -> None:
    tokens = tiny.prompt[:250] + [5, 9, 11]
    n = len(tokens)
    cuts = [0, 130, 250, n - 2, n - 1, n]  # a prompt in two chunks, then decodes
    contiguous = _run_on_pages(tiny.model, tokens, [0], 512, cuts)
    gen = torch.Generator().manual_seed(5)
    rows = 32
    table = torch.randperm(32, generator=gen)[: -(-n // rows)].tolist()
    assert table != sorted(table)
    shuffled = _run_on_pages(tiny.model, tokens, table, rows, cuts)
    assert torch.equal(shuffled, contiguous)


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
