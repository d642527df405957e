"""Exactness of lfm2_moe across passes: a stream's logits are bit-identical whether it runs alone
or beside other streams, on contiguous or shuffled pages, in a fresh slot or a reused one."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_lfm2_moe.model import load


class TestPasses(conformance.SlotPassGates):
    load = load


class TestVerifyRows(conformance.VerifyRowsGate):
    pass
