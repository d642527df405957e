"""The family contract: what a model family plugin declares (spec), implements (model) and is
handed (forward_pass, checkpoint, tokenizer, chat_template, tool_calls), the plugin host
(plugins, hookspecs, profiles) and the demos' building blocks (demo_build, demo_text).

`tensorfold.family` is the contract's public face: it exports everything spec.py defines, and
importing it loads no torch (plugins import it at registration)."""

from .spec import (
    COLUMN,
    DTYPE_BYTES,
    REPLICATED,
    ROW,
    FamilySpec,
    ModelShape,
    RowSpec,
    Shard,
    ShardPlan,
    ShardRefused,
    Split,
    StateLayout,
    StateSpec,
    block,
    resolve,
)

__all__ = [
    "COLUMN",
    "DTYPE_BYTES",
    "REPLICATED",
    "ROW",
    "FamilySpec",
    "ModelShape",
    "RowSpec",
    "Shard",
    "ShardPlan",
    "ShardRefused",
    "Split",
    "StateLayout",
    "StateSpec",
    "block",
    "resolve",
]
