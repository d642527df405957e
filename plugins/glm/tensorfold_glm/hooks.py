"""glm5_next's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py), its
tool-call format (tool_calls.py), its thinking block (`<think>` ... `</think>`), its MTP
layer as `--draft mtp`'s drafter (config.mtp_served, mtp_drafter.py) and its images
(media_processor.py). Cheap to import: no torch."""

from tensorfold.family.hooks import FamilyHooks
from tensorfold.family.reasoning import ReasoningFormat

from .config import GlmConfig, mtp_served
from .shards import plan
from .tool_calls import FORMAT

REASONING = ReasoningFormat("think", "<think>", "</think>")
HOOKS = FamilyHooks(
    GlmConfig,
    plan,
    FORMAT,
    REASONING,
    mtp_served=mtp_served,
    mtp_drafter="tensorfold_glm.mtp_drafter:open_drafter",
    media="tensorfold_glm.media_processor:media_processor",
)
