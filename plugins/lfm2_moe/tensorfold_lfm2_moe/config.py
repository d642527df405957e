"""config.json of an LFM2-MoE checkpoint, as transformers 5.23.0 writes it (`Lfm2MoeConfig`).

Defaults are the class defaults of configuration_lfm2_moe.py; `layer_types` has none there and
none here. No torch import: the core reads this before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tensorfold.family.checkpoint import CheckpointError
from tensorfold.family.rope_config import RopeRefused, rope_parameters

CONV, ATTENTION = "conv", "full_attention"
LAYER_KINDS = (CONV, ATTENTION)
DEFAULT_ROPE_THETA = 1_000_000.0


class ConfigError(CheckpointError):
    """config.json is missing a required field or holds a value this family cannot run."""


@dataclass(frozen=True)
class Lfm2MoeConfig:
    vocab_size: int = 65536
    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 64
    layer_types: tuple[str, ...] = ()
    num_dense_layers: int = 2
    num_experts: int = 32
    num_experts_per_tok: int = 4
    use_expert_bias: bool = True
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    conv_L_cache: int = 3  # the short conv's kernel size
    conv_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_ROPE_THETA
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = 0
    dtype: str | None = None  # the dtype the checkpoint was saved in, if config.json says

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == ATTENTION)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == CONV)

    def is_dense(self, layer: int) -> bool:
        return layer < self.num_dense_layers

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "Lfm2MoeConfig":
        """Parse and check config.json's fields; `source` names the file in errors."""
        return _parse(raw, source)


def _parse(raw: Mapping[str, Any], source: str) -> Lfm2MoeConfig:
    d = Lfm2MoeConfig()

    def get(key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        value = raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) and kind is not bool:
            raise ConfigError(f"{source}: {key!r} must be {_kind_name(kind)}, got {value!r}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise ConfigError(f"{source}: {key!r} must be {_kind_name(kind)}, got {value!r}")
        return value

    hidden = get("hidden_size", d.hidden_size, int)
    heads = get("num_attention_heads", d.num_attention_heads, int)
    layers = get("num_hidden_layers", d.num_hidden_layers, int)
    # Lfm2MoeConfig.__post_init__ reads the old name `tie_embedding` first.
    tie = raw.get("tie_embedding", raw.get("tie_word_embeddings"))
    cfg = Lfm2MoeConfig(
        vocab_size=get("vocab_size", d.vocab_size, int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", d.intermediate_size, int),
        moe_intermediate_size=get("moe_intermediate_size", d.moe_intermediate_size, int),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", d.num_key_value_heads, int),
        head_dim=get("head_dim", hidden // heads if heads else 0, int),
        layer_types=_layer_types(raw, layers, source),
        num_dense_layers=get("num_dense_layers", d.num_dense_layers, int),
        num_experts=get("num_experts", d.num_experts, int),
        num_experts_per_tok=get("num_experts_per_tok", d.num_experts_per_tok, int),
        use_expert_bias=get("use_expert_bias", d.use_expert_bias, bool),
        norm_topk_prob=get("norm_topk_prob", d.norm_topk_prob, bool),
        routed_scaling_factor=get("routed_scaling_factor", d.routed_scaling_factor, float),
        conv_L_cache=get("conv_L_cache", d.conv_L_cache, int),
        conv_bias=get("conv_bias", d.conv_bias, bool),
        norm_eps=get("norm_eps", d.norm_eps, float),
        rope_theta=_rope_theta(raw, source),
        max_position_embeddings=get("max_position_embeddings", d.max_position_embeddings, int),
        tie_word_embeddings=d.tie_word_embeddings if tie is None else bool(tie),
        bos_token_id=get("bos_token_id", None, int),
        eos_token_ids=_ids(raw.get("eos_token_id"), source),
        pad_token_id=get("pad_token_id", None, int),
        dtype=get("dtype", None, str) or get("torch_dtype", None, str),
    )
    _check(cfg, source)
    return cfg


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else "a value"


def _layer_types(raw: Mapping[str, Any], layers: int, source: str) -> tuple[str, ...]:
    accepted = " or ".join(f'"{k}"' for k in LAYER_KINDS)
    value = raw.get("layer_types")
    if value is None:
        raise ConfigError(
            f"{source}: 'layer_types' is required for lfm2_moe (Lfm2MoeConfig has no default): "
            f"a list of num_hidden_layers={layers} entries, each {accepted}"
        )
    if not isinstance(value, list) or len(value) != layers:
        raise ConfigError(
            f"{source}: 'layer_types' must list num_hidden_layers={layers} entries, "
            f"each {accepted}; got {value!r}"
        )
    bad = sorted({str(v) for v in value if v not in LAYER_KINDS})
    if bad:
        raise ConfigError(
            f"{source}: 'layer_types' holds {', '.join(map(repr, bad))}; "
            f"the accepted values are {accepted}"
        )
    return tuple(value)


def _rope_theta(raw: Mapping[str, Any], source: str) -> float:
    """transformers 5.x writes rope_parameters {rope_type, rope_theta}; 4.x files rope_theta
    and any scaling under rope_scaling, which transformers 5.23.0 applies first
    (family.rope_config.rope_parameters reads them so): lfm2_moe runs default RoPE only."""
    try:
        params = rope_parameters(raw, ("default",), DEFAULT_ROPE_THETA)
    except RopeRefused as e:
        raise ConfigError(f"{source}: {e} (lfm2_moe runs default RoPE only)") from None
    theta = params["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: 'rope_theta' must be a positive number, got {theta!r}")
    return float(theta)


def _ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"{source}: 'eos_token_id' must be an integer or a list of them")
    return tuple(items)


def _check(cfg: Lfm2MoeConfig, source: str) -> None:
    positive = (
        "vocab_size",
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_hidden_layers",
        "conv_L_cache",
        "max_position_embeddings",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{source}: {name!r} must be at least 1, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{source}: num_attention_heads={cfg.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    if cfg.head_dim % 2:
        raise ConfigError(f"{source}: head_dim={cfg.head_dim} must be even for rotary embeddings")
    if cfg.num_dense_layers < cfg.num_hidden_layers:
        if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
            raise ConfigError(
                f"{source}: num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and "
                f"num_experts={cfg.num_experts}"
            )
