"""Exactness of glm5_next across passes: a stream's logits are bit-identical whether it runs
alone or beside other streams, on contiguous or shuffled pages, in a fresh slot or a reused one,
with freed pages poisoned or not; states tapped mid-pass equal the states a cut pass leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pytest
import torch

from tensorfold import testing
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.forward_pass import StreamRows
from tensorfold_glm.model import GlmModel, load

if TYPE_CHECKING:
    from conftest import Tiny


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (200, 250, 37)]


def _model(tiny: "Tiny", dtype: str) -> GlmModel:
    return tiny.model if dtype == "float32" else load(Checkpoint.open(tiny.path), "cpu", dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("together", [(0, 1), (1, 2), (0, 1, 2)])
def test_streams_in_one_pass_equal_streams_alone(
    tiny: "Tiny", dtype: str, together: Sequence[int]
) -> None:
    model = _model(tiny, dtype)
    prompts = _prompts()
    testing.assert_streams_together_equal_alone(
        tiny.runner, model, prompts, together, num_pages=6, max_rows=600
    )


def test_shuffled_page_table_gives_identical_logits(tiny: "Tiny") -> None:
    tokens = tiny.prompt[:400] + [5, 9, 11]
    n = len(tokens)
    cuts = [0, 150, 400, n - 2, n - 1, n]  # a prompt in two chunks, then decodes
    testing.assert_shuffled_pages_change_nothing(tiny.model, tokens, cuts)


def test_reused_slot_starts_from_zero_state(tiny: "Tiny") -> None:
    testing.assert_reused_slot_starts_clean(tiny.runner, tiny.prompt)


def test_poisoned_free_pages_change_nothing(tiny: "Tiny") -> None:
    testing.assert_poisoned_pages_change_nothing(tiny.runner, tiny.prompt)


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
