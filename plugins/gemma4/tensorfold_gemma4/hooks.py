"""gemma4's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py) and its
tool-call format (tool_calls.py). Cheap to import: no torch."""

from tensorfold.family.hooks import FamilyHooks

from .config import Gemma4Config
from .shards import plan
from .tool_calls import FORMAT

HOOKS = FamilyHooks(Gemma4Config, plan, FORMAT)
