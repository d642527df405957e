"""drafted == plain on the demo checkpoint (the conformance suite's DraftGates): the sliding
rings rewind to the last kept row."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_gemma4.demo import build_demo


class TestDrafts(conformance.DraftGates):
    family, build_demo = "gemma4", build_demo
