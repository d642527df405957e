"""TF_LOAD_FORMAT=dummy: a checkpoint folder with no weights serves the config's shape with
random weights from a fixed seed (for benchmarks), through the same lanes."""

from __future__ import annotations

from tensorfold import conformance
from tensorfold_lfm2_moe.demo import build_demo


class TestDummyWeights(conformance.DummyWeights):
    family, build_demo = "lfm2_moe", build_demo
