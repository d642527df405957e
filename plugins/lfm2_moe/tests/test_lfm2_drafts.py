"""drafted == plain on the demo checkpoint (the conformance suite's DraftGates)."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_lfm2_moe.demo import build_demo


class TestDrafts(conformance.DraftGates):
    family, build_demo = "lfm2_moe", build_demo
