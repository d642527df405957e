"""lfm2_moe's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py), its
tool-call format (tool_calls.py) and its
thinking block (`<think>` ... `</think>`). Cheap to import: no torch."""

from tensorfold.family.hooks import FamilyHooks
from tensorfold.family.reasoning import ReasoningFormat

from .config import Lfm2MoeConfig
from .shards import plan
from .tool_calls import FORMAT

REASONING = ReasoningFormat("think", "<think>", "</think>")
HOOKS = FamilyHooks(Lfm2MoeConfig, plan, FORMAT, REASONING)
