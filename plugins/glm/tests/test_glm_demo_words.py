"""The glm5_next demo checkpoint writes words and thinks as its template asks, thinking on by default, like GLM's
(tensorfold.conformance.DemoReplies)."""

from tensorfold import conformance
from tensorfold_glm.demo import build_demo


class TestDemoReplies(conformance.DemoReplies):
    family, build_demo, thinking_by_default = "glm5_next", build_demo, True
