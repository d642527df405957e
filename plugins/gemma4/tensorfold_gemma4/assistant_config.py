"""config.json of a Gemma 4 assistant (drafter) checkpoint, as transformers 5.23.0 writes it.

`Gemma4AssistantConfig` (configuration_gemma4_assistant.py): a `gemma4_text` config under
`text_config` (the drafter's own small stack), `backbone_hidden_size` (the target's hidden size),
and the optional centroid-masked head: `use_ordered_embeddings`, `num_centroids` (2048 by
default), `centroid_intermediate_top_k` (32). Every layer of the stack reuses K/V
(`num_kv_shared_layers == num_hidden_layers`): it has no k/v projections and reads the target's.

The text config is parsed by config.py with `num_kv_shared_layers` set to 0, so head_dim, RoPE
and windows are derived as the target's are; the reference's architecture checks (no per-layer
embeddings, no MoE, no double-wide MLP) are repeated here. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .config import ConfigError, Fields, Gemma4Config

MODEL_TYPE = "gemma4_assistant"


@dataclass(frozen=True)
class AssistantConfig:
    text: Gemma4Config  # the drafter's stack; each layer's kv_source is -1: the target's
    backbone_hidden_size: int  # the target's hidden size: inputs [embed ‖ hidden] are 2x this
    use_ordered_embeddings: bool  # the centroid-masked head instead of the full tied head
    num_centroids: int
    centroid_top_k: int  # clusters kept a row (centroid_intermediate_top_k)

    @property
    def tokens_per_centroid(self) -> int:
        return self.text.vocab_size // self.num_centroids

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "AssistantConfig":
        """Parse and check an assistant's config.json; `source` names the file in errors."""
        get = Fields(raw, source)
        model_type = get("model_type", MODEL_TYPE, str)
        if model_type != MODEL_TYPE:
            raise ConfigError(f"{source}: model_type {model_type!r} is not {MODEL_TYPE!r}")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: an assistant needs its 'text_config' object")
        where = f"{source} text_config"
        n = Fields(text, where)("num_hidden_layers", 30, int)
        shared = Fields(text, where)("num_kv_shared_layers", n, int)
        if shared not in (0, n):  # the reference sets 0 (unset) to n itself
            raise ConfigError(
                f"{where}: every assistant layer reuses the target's K/V; "
                f"num_kv_shared_layers={shared} must equal num_hidden_layers={n}"
            )
        cfg = Gemma4Config.from_dict({**text, "num_kv_shared_layers": 0}, where)
        for name, bad in (
            ("hidden_size_per_layer_input", cfg.hidden_size_per_layer_input != 0),
            ("vocab_size_per_layer_input", cfg.vocab_size_per_layer_input != 0),
            ("enable_moe_block", cfg.enable_moe_block),
            ("use_double_wide_mlp", bool(text.get("use_double_wide_mlp"))),
        ):
            if bad:
                raise ConfigError(f"{where}: an assistant has no {name} (got {text.get(name)!r})")
        # every layer reads the target's store layer of its kind: a "reuse" layer (kv_source -1)
        cfg = replace(cfg, layers=tuple(replace(layer, kv_source=-1) for layer in cfg.layers))
        out = cls(
            text=cfg,
            backbone_hidden_size=get("backbone_hidden_size", 1536, int),
            use_ordered_embeddings=get("use_ordered_embeddings", False, bool),
            num_centroids=get("num_centroids", 2048, int),
            centroid_top_k=get("centroid_intermediate_top_k", 32, int),
        )
        if out.use_ordered_embeddings and not (
            0 < out.centroid_top_k <= out.num_centroids and cfg.vocab_size % out.num_centroids == 0
        ):
            raise ConfigError(
                f"{source}: the centroid head needs 0 < centroid_intermediate_top_k="
                f"{out.centroid_top_k} <= num_centroids={out.num_centroids}, dividing "
                f"vocab_size={cfg.vocab_size}"
            )
        return out
