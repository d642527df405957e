"""The lfm2_moe demo checkpoint writes words and thinks as its template asks, thinking on by default
(tensorfold.conformance.DemoReplies)."""

from tensorfold import conformance
from tensorfold_lfm2_moe.demo import build_demo


class TestDemoReplies(conformance.DemoReplies):
    family, build_demo, thinking_by_default = "lfm2_moe", build_demo, True
