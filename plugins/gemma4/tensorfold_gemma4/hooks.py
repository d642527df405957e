"""gemma4's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py), its
tool-call format (tool_calls.py), its thinking channel (`<|channel>thought\\n` ...
`<channel|>`), its draft model (the assistant, assistant_drafter.py) and its images (media.py).
Cheap to import: no torch."""

from tensorfold.family.hooks import FamilyHooks
from tensorfold.family.reasoning import ReasoningFormat

from .config import Gemma4Config
from .shards import plan
from .tool_calls import FORMAT

REASONING = ReasoningFormat("gemma4", "<|channel>thought\n", "<channel|>")
HOOKS = FamilyHooks(
    Gemma4Config,
    plan,
    FORMAT,
    REASONING,
    "tensorfold_gemma4.assistant_drafter:open_drafter",
    media="tensorfold_gemma4.media:media_processor",
)
