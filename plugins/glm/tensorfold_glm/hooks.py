"""glm5_next's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py) and its
tool-call format (tool_calls.py). Cheap to import: no torch."""

from tensorfold.family.hooks import FamilyHooks

from .config import GlmConfig
from .shards import plan
from .tool_calls import FORMAT

HOOKS = FamilyHooks(GlmConfig, plan, FORMAT)
