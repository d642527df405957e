"""Exactness of glm5_next across passes: a stream's logits are bit-identical whether it runs
alone or beside other streams, on contiguous or shuffled pages, in a fresh slot or a reused one,
with freed pages poisoned or not; states tapped mid-pass equal the states a cut pass leaves."""

from __future__ import annotations

import torch

from tensorfold import conformance, testing
from tensorfold.family.forward_pass import StreamRows
from tensorfold_glm.model import load


class TestPasses(conformance.SlotPassGates):
    load = load
    pass_ids_high = 250
    shuffle_rows, shuffle_cut = 400, 150

    def test_taps_inside_a_pass_equal_the_state_a_cut_leaves(
        self, tiny: testing.ReferenceCase
    ) -> None:
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


class TestVerifyRows(conformance.VerifyRowsGate):
    pass
