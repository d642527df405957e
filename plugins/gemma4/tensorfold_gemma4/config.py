"""config.json of a Gemma 4 checkpoint, as transformers 5.23.0 writes it.

`Gemma4ForConditionalGeneration` nests the text model under `text_config` (beside optional
`vision_config` and `audio_config`); `Gemma4ForCausalLM` writes the text config flat. Defaults are
the `Gemma4TextConfig` class defaults (configuration_gemma4.py), and `__post_init__`'s derived
values are derived here the same way: default `layer_types` (every 6th layer full, the last one
forced full), default RoPE per layer type, and the full layers' per-layer override of `head_dim`
(and of `num_key_value_heads` under `attention_k_eq_v`) unless config.json carries
`per_layer_config` itself. No torch import: the core reads this before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from tensorfold.family.checkpoint import CheckpointError

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_KINDS = (SLIDING, FULL)
ROPE_KINDS = ("default", "proportional")
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_python_tanh")  # the same tanh approximation
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


class ConfigError(CheckpointError):
    """config.json is missing a required field or holds a value this family cannot run."""


@dataclass(frozen=True)
class Rope:
    """One layer type's rotary embedding. "default": theta^(-2i/D) for all D/2 frequencies;
    "proportional": the first int(partial_rotary_factor * D // 2) of those, the rest 0 (identity),
    all divided by `factor`."""

    rope_type: str
    theta: float
    partial_rotary_factor: float = 1.0
    factor: float = 1.0


@dataclass(frozen=True)
class Layer:
    """One decoder layer as the reference builds it."""

    index: int
    kind: str  # SLIDING or FULL
    head_dim: int
    kv_heads: int
    window: int | None  # sliding layers: a query at t sees keys t - window < j <= t
    k_eq_v: bool  # no v_proj: V is v_norm of the raw k_proj output
    kv_source: int  # the layer whose K/V rows it reads: itself, or the "store" layer it reuses
    mlp_size: int  # the dense GeGLU's width (doubled on reuse layers with use_double_wide_mlp)

    @property
    def reuses_kv(self) -> bool:
        return self.kv_source != self.index


@dataclass(frozen=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    layers: tuple[Layer, ...]
    rope: Mapping[str, Rope]  # by layer kind
    rms_norm_eps: float
    final_logit_softcapping: float | None
    enable_moe_block: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    hidden_size_per_layer_input: int  # 0: no per-layer embeddings (PLE)
    vocab_size_per_layer_input: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    pad_token_id: int
    multimodal_token_ids: tuple[int, ...]  # placeholders the reference embeds as the pad token
    has_vision: bool
    has_audio: bool
    # use_bidirectional_attention == "vision": an image's rows attend to each other both ways in
    # the sliding layers (ForwardPass.attend_upto); full layers stay causal
    vision_blocks: bool = False

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(layer.kind for layer in self.layers)

    def head_dim(self, kind: str) -> int:
        """The head_dim of the first layer of `kind` (all of a kind share it)."""
        return next(layer.head_dim for layer in self.layers if layer.kind == kind)

    @property
    def has_ple(self) -> bool:
        return self.hidden_size_per_layer_input > 0

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "Gemma4Config":
        """Parse and check config.json's fields; `source` names the file in errors."""
        return _parse(raw, source)


class Fields:
    """Typed reads from one config object (the text, vision or audio config), with the file and
    section named in errors."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def __call__(self, key: str, default: Any, kind: type) -> Any:
        value = self.raw.get(key)
        if value is None:
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
            raise ConfigError(f"{self.source}: {key!r} must be {names[kind]}, got {value!r}")
        return value


def _parse(raw: Mapping[str, Any], source: str) -> Gemma4Config:
    text = raw.get("text_config")
    nested = isinstance(text, dict)
    t: Mapping[str, Any] = text if nested else raw  # type: ignore[assignment]
    get = Fields(t, f"{source} text_config" if nested else source)
    top = Fields(raw, source)
    if get("use_bidirectional_attention", None, str) == "all":
        raise ConfigError(
            f"{get.source}: use_bidirectional_attention='all' makes every layer bidirectional; "
            "gemma4 serves causal language models only"
        )
    if get("attention_bias", False, bool):
        raise ConfigError(f"{get.source}: attention_bias=true is not supported by gemma4")
    activation = get("hidden_activation", ACTIVATIONS[0], str)
    if activation not in ACTIVATIONS:
        raise ConfigError(
            f"{get.source}: hidden_activation {activation!r} is not supported; gemma4 runs "
            + " or ".join(map(repr, ACTIVATIONS))
        )
    n_layers = get("num_hidden_layers", 30, int)
    heads = get("num_attention_heads", 8, int)
    kinds = _layer_types(t.get("layer_types"), n_layers, get.source)
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings"))
    placeholders = {"image_token_id": 258_880, "video_token_id": 258_884, "audio_token_id": 258_881}
    cfg = Gemma4Config(
        vocab_size=get("vocab_size", 262_144, int),
        hidden_size=get("hidden_size", 2304, int),
        intermediate_size=get("intermediate_size", 9216, int),
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        layers=_layers(get, kinds),
        rope=_rope(t.get("rope_scaling"), t.get("rope_parameters"), kinds, get.source),
        rms_norm_eps=get("rms_norm_eps", 1e-6, float),
        final_logit_softcapping=get("final_logit_softcapping", None, float),
        enable_moe_block=get("enable_moe_block", False, bool),
        num_experts=get("num_experts", 0, int),
        top_k_experts=get("top_k_experts", 0, int),
        moe_intermediate_size=get("moe_intermediate_size", 0, int),
        hidden_size_per_layer_input=get("hidden_size_per_layer_input", 256, int),
        vocab_size_per_layer_input=get("vocab_size_per_layer_input", 262_144, int),
        max_position_embeddings=get("max_position_embeddings", 131_072, int),
        tie_word_embeddings=True if tie is None else bool(tie),
        pad_token_id=get("pad_token_id", 0, int),
        # Gemma4Model (the ConditionalGeneration body) embeds these ids as the pad token when no
        # image, video or audio fills them; the text-only Gemma4ForCausalLM embeds them as given.
        multimodal_token_ids=tuple(top(k, v, int) for k, v in placeholders.items() if nested),
        has_vision=nested and raw.get("vision_config") is not None,
        has_audio=nested and raw.get("audio_config") is not None,
        vision_blocks=get("use_bidirectional_attention", None, str) == "vision",
    )
    _check(cfg, get.source)
    return cfg


def _layer_types(value: Any, n_layers: int, source: str) -> tuple[str, ...]:
    if value is None:
        kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(n_layers)]
    elif not isinstance(value, list) or len(value) != n_layers:
        raise ConfigError(
            f"{source}: 'layer_types' must list num_hidden_layers={n_layers} entries; got {value!r}"
        )
    else:
        kinds = list(value)
    bad = sorted({str(k) for k in kinds if k not in LAYER_KINDS})
    if bad:
        accepted = " or ".join(f'"{k}"' for k in LAYER_KINDS)
        raise ConfigError(
            f"{source}: 'layer_types' holds {', '.join(map(repr, bad))}; "
            f"the accepted values are {accepted}"
        )
    if kinds:
        kinds[-1] = FULL  # as the reference: "Last layer must use full_attention"
    return tuple(kinds)


def _per_layer(get: Fields, kinds: tuple[str, ...]) -> dict[int, dict[str, int]]:
    """The per-layer overrides: config.json's `per_layer_config`, or the reference's default."""
    given = get.raw.get("per_layer_config")
    if given is None:
        overrides: dict[str, int] = {"head_dim": get("global_head_dim", 512, int)}
        global_kv = get("num_global_key_value_heads", None, int)
        if get("attention_k_eq_v", False, bool) and global_kv is not None:
            overrides["num_key_value_heads"] = global_kv
        return {i: overrides for i, kind in enumerate(kinds) if kind == FULL}
    if not isinstance(given, dict):
        raise ConfigError(f"{get.source}: 'per_layer_config' must be an object, got {given!r}")
    out: dict[int, dict[str, int]] = {}
    for key, entry in given.items():
        if not str(key).isdigit() or int(key) >= len(kinds) or not isinstance(entry, dict):
            raise ConfigError(
                f"{get.source}: per_layer_config[{key!r}] must be a layer index "
                f"below {len(kinds)} holding an object, got {entry!r}"
            )
        unknown = sorted(set(entry) - set(PER_LAYER_KEYS))
        if unknown:
            raise ConfigError(
                f"{get.source}: per_layer_config[{key!r}] overrides {unknown}; "
                f"gemma4 supports per-layer {' and '.join(PER_LAYER_KEYS)} only"
            )
        f = Fields(entry, f"{get.source} per_layer_config[{key!r}]")
        out[int(key)] = {name: f(name, None, int) for name in entry}
    return out


def _layers(get: Fields, kinds: tuple[str, ...]) -> tuple[Layer, ...]:
    n = len(kinds)
    head_dim = get("head_dim", 256, int)
    kv_heads = get("num_key_value_heads", 4, int)
    window = get("sliding_window", 512, int)
    k_eq_v = get("attention_k_eq_v", False, bool)
    shared = get("num_kv_shared_layers", 0, int)
    if not 0 <= shared < n:
        raise ConfigError(
            f"{get.source}: num_kv_shared_layers={shared} must be between 0 and "
            f"num_hidden_layers - 1 = {n - 1}"
        )
    first_reuse = n - shared
    # kv_sharing_modes: each reuse layer reads the last non-reuse layer of its type ("store").
    store = {
        kind: max((i for i in range(first_reuse) if kinds[i] == kind), default=-1)
        for kind in set(kinds)
    }
    if shared and min(store.values()) < 0:
        raise ConfigError(
            f"{get.source}: with num_kv_shared_layers={shared}, every layer type "
            "must have a non-shared layer to store the K/V its reuse layers read"
        )
    double = get("use_double_wide_mlp", False, bool)
    width = get("intermediate_size", 9216, int)
    per_layer = _per_layer(get, kinds)
    layers = []
    for i, kind in enumerate(kinds):
        own = per_layer.get(i, {})
        reuse = i >= first_reuse
        layers.append(
            Layer(
                index=i,
                kind=kind,
                head_dim=int(own.get("head_dim", head_dim)),
                kv_heads=int(own.get("num_key_value_heads", kv_heads)),
                window=window if kind == SLIDING else None,
                k_eq_v=k_eq_v and kind == FULL,
                kv_source=store[kind] if reuse else i,
                mlp_size=width * (2 if double and reuse else 1),
            )
        )
    return tuple(layers)


def _rope(scaling: Any, value: Any, kinds: tuple[str, ...], source: str) -> dict[str, Rope]:
    if scaling:  # transformers 5.23.0 would apply it in place of rope_parameters
        raise ConfigError(
            f"{source}: 'rope_scaling' {scaling!r} is not supported by gemma4, which reads its "
            f"RoPE by layer type from 'rope_parameters' (rope_type "
            f"{' or '.join(map(repr, ROPE_KINDS))})"
        )
    params = DEFAULT_ROPE if value is None else value
    if not isinstance(params, dict) or "rope_type" in params:
        raise ConfigError(
            f"{source}: 'rope_parameters' must map each layer type "
            f"({', '.join(LAYER_KINDS)}) to its RoPE parameters, got {value!r}"
        )
    out = {}
    for kind in sorted(set(kinds)):
        entry = params.get(kind)
        if not isinstance(entry, dict):
            raise ConfigError(f"{source}: rope_parameters has no object for {kind!r}")
        f = Fields(entry, f"{source} rope_parameters[{kind!r}]")
        rope_type = f("rope_type", "default", str)
        if rope_type not in ROPE_KINDS:
            raise ConfigError(
                f"{f.source}: rope_type {rope_type!r} is not supported by gemma4 "
                f"(only {' or '.join(map(repr, ROPE_KINDS))})"
            )
        theta = f("rope_theta", None, float)
        if theta is None or theta <= 0:
            raise ConfigError(f"{f.source}: 'rope_theta' must be a positive number")
        out[kind] = Rope(
            rope_type, theta, f("partial_rotary_factor", 1.0, float), f("factor", 1.0, float)
        )
    return out


def _check(cfg: Gemma4Config, source: str) -> None:
    positive = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
    )
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{source}: {name!r} must be at least 1, got {getattr(cfg, name)}")
    for layer in cfg.layers:
        where = f"{source}: layer {layer.index} ({layer.kind})"
        if layer.head_dim < 2 or layer.head_dim % 2 or layer.kv_heads < 1:
            raise ConfigError(
                f"{where} has head_dim={layer.head_dim} and "
                f"{layer.kv_heads} KV heads; head_dim must be even, heads positive"
            )
        if cfg.num_attention_heads % layer.kv_heads:
            raise ConfigError(
                f"{where}: num_attention_heads={cfg.num_attention_heads} is not a "
                f"multiple of its {layer.kv_heads} KV heads"
            )
        if layer.head_dim != cfg.head_dim(layer.kind):
            raise ConfigError(
                f"{where} has head_dim={layer.head_dim}, another {layer.kind} layer "
                f"{cfg.head_dim(layer.kind)}: RoPE needs one head_dim a layer type"
            )
        if layer.window is not None and layer.window < 1:
            raise ConfigError(f"{source}: sliding_window must be at least 1, got {layer.window}")
    if cfg.enable_moe_block and not (
        cfg.moe_intermediate_size > 0 and 1 <= cfg.top_k_experts <= cfg.num_experts
    ):
        raise ConfigError(
            f"{source}: enable_moe_block needs moe_intermediate_size > 0 and 1 <= top_k_experts="
            f"{cfg.top_k_experts} <= num_experts={cfg.num_experts}"
        )
