"""The family's per-family hook object (FamilySpec.hooks): tensor parallel (shards.py) and its
tool-call format (tool_calls.py). Cheap to import: no torch."""

from __future__ import annotations

from typing import Any, Mapping

from tensorfold import hookimpl
from tensorfold.family.tool_calls import ToolCallFormat

from .shards import _Hooks as _ShardHooks
from .tool_calls import FORMAT


class _Hooks(_ShardHooks):
    @hookimpl
    def tool_call_format(self, config: Mapping[str, Any]) -> ToolCallFormat:
        return FORMAT


HOOKS = _Hooks()
