"""A family's per-family hook object (FamilySpec.hooks) built from what the family knows: how it
reads a config.json, how it cuts across tensor-parallel ranks, its tool-call format, its
thinking markup and its drafters. Cheap to import: no torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from tensorfold.family import ShardPlan, resolve
from tensorfold.family.hookspecs import hookimpl
from tensorfold.family.reasoning import ReasoningFormat
from tensorfold.family.tool_calls import ToolCallFormat

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint


class ConfigReader(Protocol):
    """A family's config class: `from_dict(raw, source)` parses a config.json's mapping."""

    def from_dict(self, raw: Mapping[str, Any], source: str = ...) -> Any: ...


class FamilyHooks:
    """`shard_plan`, `tool_call_format`, `reasoning_format`, `mtp_config` and `model_drafter`
    for one family: `plan(cfg, dtype, world)` on the config `config.from_dict` reads,
    `tool_calls`, `reasoning`; for `--draft model`, `drafter`, a "module:function" imported
    when asked (function(model, runner, folder) -> ModelDrafter: torch loads only then); for
    `--draft mtp`, `mtp_served(checkpoint) -> dict` (the config to load with, called before
    any weight loads: keep it cheap) and `mtp_drafter`, a "module:function" imported when asked
    (function(model, runner) -> ModelDrafter); for images, `media`, a "module:function"
    imported when asked (function(folder, config) -> MediaProcessor | None). A part left out
    (None) is answered by the core's default."""

    def __init__(
        self,
        config: ConfigReader,
        plan: Callable[[Any, str, int], ShardPlan] | None = None,
        tool_calls: ToolCallFormat | None = None,
        reasoning: ReasoningFormat | None = None,
        drafter: str | None = None,
        mtp_served: Callable[["Checkpoint"], dict[str, Any]] | None = None,
        mtp_drafter: str | None = None,
        media: str | None = None,
    ) -> None:
        self.config, self.plan, self.tool_calls = config, plan, tool_calls
        self.reasoning, self.drafter = reasoning, drafter
        self.mtp_served, self.mtp_drafter = mtp_served, mtp_drafter
        self.media = media

    @hookimpl
    def shard_plan(self, config: Mapping[str, Any], dtype: str, world: int) -> ShardPlan | None:
        if self.plan is None:
            return None
        return self.plan(self.config.from_dict(config, "config.json"), str(dtype), world)

    @hookimpl
    def tool_call_format(self, config: Mapping[str, Any]) -> ToolCallFormat | None:
        return self.tool_calls

    @hookimpl
    def reasoning_format(self, config: Mapping[str, Any]) -> ReasoningFormat | None:
        return self.reasoning

    @hookimpl
    def mtp_config(self, checkpoint: "Checkpoint") -> dict[str, Any] | None:
        return None if self.mtp_served is None else self.mtp_served(checkpoint)

    @hookimpl
    def model_drafter(self, model: Any, runner: Any, folder: Path | None) -> Any:
        if folder is None:
            return None if self.mtp_drafter is None else resolve(self.mtp_drafter)(model, runner)
        return None if self.drafter is None else resolve(self.drafter)(model, runner, folder)

    @hookimpl
    def media_processor(self, folder: Path | None, config: Mapping[str, Any]) -> Any:
        return None if self.media is None else resolve(self.media)(folder, config)
