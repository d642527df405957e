"""Exactness of gemma4 across passes: a stream's logits are bit-identical whether it runs alone or
beside other streams, on contiguous or shuffled pages, with freed pages poisoned or not."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_gemma4.model import load


class TestPasses(conformance.PassGates):
    load = load
    together_grid = [("float32", (0, 1)), ("float32", (0, 1, 2)), ("bfloat16", (0, 1, 2))]
    pass_lengths, pass_pages = (180, 230, 37), (3, 300)
    shuffle_rows, shuffle_cut, shuffle_pool = 250, 130, 32


class TestVerifyRows(conformance.VerifyRowsGate):
    pass
