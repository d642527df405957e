"""GLM-5.3-Flash's vision tower config: the fields of config.json's `vision_config` the tower
reads (transformers 5.23.0 `Glm5NextVisionConfig`), and what it refuses. No torch: the memory
plan reads it before anything loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["VisionConfig"]


@dataclass(frozen=True)
class VisionConfig:
    """The fields of config.json's vision_config the tower reads (defaults: the class's)."""

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0
    attention_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """The values of one pixel row: channels x temporal_patch_size x patch_size²."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "vision_config") -> "VisionConfig":
        """Refuses what the tower does not compute: another activation or RoPE type, a
        non-square patch, a head_dim not divisible by 4 (two axes, each rotated in halves)."""
        act = raw.get("hidden_act", "silu")
        rope = dict(raw.get("rope_parameters") or {})
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r}: only 'silu' is supported")
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"{source}: rope_type {rope['rope_type']!r}: only 'axial'")
        fields = {f: raw[f] for f in cls.__dataclass_fields__ if f in raw}
        for f in ("patch_size", "temporal_patch_size"):
            if isinstance(fields.get(f), (list, tuple)):
                raise ValueError(f"{source}: {f} {fields[f]!r}: only an int is supported")
        if "rope_theta" in rope:
            fields["rope_theta"] = float(rope["rope_theta"])
        cfg = cls(**fields)
        if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
            raise ValueError(f"{source}: head_dim must be a whole multiple of 4")
        return cfg
