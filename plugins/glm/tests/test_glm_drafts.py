"""drafted == plain on the demo checkpoint (the conformance suite's DraftGates): verify runs
stay recurrent in the KDA layers, their taps rewind the KDA and conv states."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_glm.demo import build_demo


class TestDrafts(conformance.DraftGates):
    family, build_demo = "glm5_next", build_demo
    chat_turn_words = (80, 50)  # the store keeps states on the 64-row KDA grid: turns past it
