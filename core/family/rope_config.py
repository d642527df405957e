"""A config.json's rotary-embedding parameters, read as transformers 5.23.0 reads them, and the
refusal of a RoPE type the library does not compute (no torch: config parsers run before any
weight loads). `tensorfold.ops.rope.scaled_inv_freq` computes the types ROPE_TYPES names."""

from __future__ import annotations

from typing import Any, Mapping

# The rope_type values ops.rope.scaled_inv_freq computes. transformers' "yarn", "dynamic",
# "longrope" and others scale the attention or change with the sequence's length: refused.
ROPE_TYPES = ("default", "linear", "llama3")
_NEEDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


class RopeRefused(ValueError):
    """A config's RoPE this library (or a family) does not compute; the message names its type
    and the accepted ones."""


def rope_parameters(
    config: Mapping[str, Any],
    accepted: tuple[str, ...] = ROPE_TYPES,
    default_theta: float = 10000.0,
) -> dict[str, Any]:
    """A flat config.json's RoPE parameters as transformers 5.23.0 reads them: `rope_scaling`
    (where transformers 4.x wrote llama3 / yarn / linear scaling) wins over `rope_parameters`;
    `type` is read as `rope_type` (default "default"); `rope_theta` (else `default_theta`) and
    llama3's `original_max_position_embeddings` (else `max_position_embeddings`) come from the
    top level where the dict has none. Raises RopeRefused for a rope_type not in `accepted` (a
    family's subset of ROPE_TYPES), or one missing a number its scaling needs."""
    raw = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(raw, Mapping):
        raise RopeRefused(f"'rope_scaling' / 'rope_parameters' must be an object, got {raw!r}")
    params = dict(raw)
    rope_type = params.setdefault("rope_type", params.get("type", "default"))
    if rope_type not in accepted:
        raise RopeRefused(
            f"rope_type {rope_type!r} ({raw}) is not implemented; accepted: "
            + ", ".join(map(repr, accepted))
        )
    params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    if rope_type == "llama3" and "max_position_embeddings" in config:
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    missing = [
        k
        for k in _NEEDS.get(rope_type, ())
        if isinstance(params.get(k), bool) or not isinstance(params.get(k), (int, float))
    ]
    if missing:
        raise RopeRefused(f"rope_type {rope_type!r} needs {', '.join(missing)}: {raw}")
    return params
