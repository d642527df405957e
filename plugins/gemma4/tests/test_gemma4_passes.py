"""Exactness of gemma4 across passes: a stream's logits are bit-identical whether it runs alone or
beside other streams, on contiguous or shuffled pages, with freed pages poisoned or not."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pytest
import torch

from tensorfold import testing
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_gemma4.model import Gemma4Model, load

if TYPE_CHECKING:
    from conftest import Tiny


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (180, 230, 37)]


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
    testing.assert_streams_together_equal_alone(
        tiny.runner, model, prompts, together, num_pages=3, max_rows=300
    )


def test_shuffled_page_table_gives_identical_logits(tiny: "Tiny") -> None:
    tokens = tiny.prompt[:250] + [5, 9, 11]
    n = len(tokens)
    cuts = [0, 130, 250, n - 2, n - 1, n]  # a prompt in two chunks, then decodes
    testing.assert_shuffled_pages_change_nothing(tiny.model, tokens, cuts, pool=32)


def test_poisoned_free_pages_change_nothing(tiny: "Tiny") -> None:
    testing.assert_poisoned_pages_change_nothing(tiny.runner, tiny.prompt)
