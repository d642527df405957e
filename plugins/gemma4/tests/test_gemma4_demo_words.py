"""The gemma4 demo checkpoint writes words and thinks as its template asks, thinking off by default, like Gemma 4's
(tensorfold.conformance.DemoReplies)."""

from tensorfold import conformance
from tensorfold_gemma4.demo import build_demo


class TestDemoReplies(conformance.DemoReplies):
    family, build_demo, thinking_by_default = "gemma4", build_demo, False
