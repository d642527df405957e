"""config.json of a GLM-5.3-Flash checkpoint, as transformers 5.23.0 reads it
(`Glm5NextTextConfig`).

Defaults are the class defaults of configuration_glm5_next.py (GLM-5.3-Flash). A composite
checkpoint keeps the text model's fields under `text_config`; a flat text-only one keeps them at
the top level. No torch import: the core reads this before any weight loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from tensorfold.family.checkpoint import CheckpointError

if TYPE_CHECKING:
    from tensorfold.family.checkpoint import Checkpoint

KDA, MLA = "linear_attention", "indexed_attention"
DENSE, SPARSE = "dense", "sparse"
FULL, SHARED = "full", "shared"


class ConfigError(CheckpointError):
    """config.json is missing a required field or holds a value this family cannot run."""


@dataclass(frozen=True)
class GlmConfig:
    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 288
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    qk_nope_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    swiglu_limit: float = 10.0
    linear_head_dim: int = 128
    linear_num_heads: int = 64
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    # the MTP layer (index num_hidden_layers): present when config.json declares
    # num_nextn_predict_layers (DeepSeek's and GLM's key) or num_mtp_layers (transformers') >= 1;
    # only the first is run. Its kinds: a layer_types / mlp_layer_types list one entry longer
    # than num_hidden_layers names them; else MLA with its own indexer and MoE, as DeepSeek-V3's.
    num_nextn_predict_layers: int = 0  # as served: 0 unless drafting with it (mtp_served)
    mtp_layer_type: str = MLA
    mtp_mlp_type: str = SPARSE
    tie_word_embeddings: bool = False
    has_vision: bool = False  # config.json has a vision_config (the tower: vision_weights.py)
    dtype: str | None = None  # the dtype the checkpoint was saved in, if config.json says

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == KDA)

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == MLA)

    @property
    def mtp_layer(self) -> int | None:
        """The MTP layer's index (num_hidden_layers), or None when config.json declares none."""
        return self.num_hidden_layers if self.num_nextn_predict_layers > 0 else None

    def runs_indexer(self, layer: int) -> bool:
        """An MLA layer with its own indexer; a "shared" one reuses the previous layer's pools."""
        return self.layer_types[layer] == MLA and self.indexer_types[layer] == FULL

    @property
    def kda_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def select_pools(self) -> int:
        """How many complete pools a query attends to at most (besides its tail)."""
        return self.index_topk // self.index_kpool

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "GlmConfig":
        """Parse and check config.json's fields; `source` names the file in errors."""
        return _parse(raw, source)


class _Fields:
    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def __call__(self, key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) and kind is not bool:
            raise ConfigError(f"{self.source}: {key!r} must be {_kind_name(kind)}, got {value!r}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            raise ConfigError(f"{self.source}: {key!r} must be {_kind_name(kind)}, got {value!r}")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, str(kind)) if isinstance(kind, type) else "a value"


_mtp_served = [False]  # see serve_mtp
# a key of the config dict `mtp_served` answers: parse it with the MTP layer in
SERVE_MTP_KEY = "tensorfold_serve_mtp"


def serve_mtp(on: bool = True) -> bool:
    """Whether configs parsed from now on load the MTP layer (its weights, and its rows in the
    layout), for the module's tests and the demo trainer. A server loads it only with `--draft
    mtp`, through the config `mtp_served` answers; otherwise a checkpoint that declares it
    serves as before, with no memory spent on it. Returns what it was."""
    was, _mtp_served[0] = _mtp_served[0], on
    return was


def mtp_served(checkpoint: "Checkpoint") -> dict[str, Any]:
    """`--draft mtp` (the mtp_config hook): config.json with SERVE_MTP_KEY set, so its parse
    loads the MTP layer; a CheckpointError naming what is missing when config.json declares
    none or the checkpoint's files hold none of its weights (a checkpoint opened without
    weights, TF_LOAD_FORMAT=dummy, is checked by its config alone)."""
    served = {**checkpoint.config, SERVE_MTP_KEY: True}
    cfg = _parse(served, str(checkpoint.path / "config.json"))
    if cfg.mtp_layer is None:
        raise CheckpointError(
            f"{checkpoint.path / 'config.json'} declares no MTP layer "
            "(num_nextn_predict_layers is 0 or absent)"
        )
    names = [
        f"{p}layers.{cfg.mtp_layer}.eh_proj.weight" for p in ("model.language_model.", "model.")
    ]
    if checkpoint.tensor_names() and not any(checkpoint.has(n) for n in names):
        raise CheckpointError(
            f"{checkpoint.path} declares an MTP layer (layer {cfg.mtp_layer}) but its weights "
            f"hold none ({names[0]} absent)"
        )
    return served


def _parse(top: Mapping[str, Any], source: str) -> GlmConfig:
    nested = top.get("text_config")
    raw: Mapping[str, Any] = nested if isinstance(nested, dict) else top
    src = f"{source} (text_config)" if raw is not top else source
    get, d = _Fields(raw, src), GlmConfig()
    layers = get("num_hidden_layers", d.num_hidden_layers, int)
    linear = _linear_attn(raw, d, src)
    tie = top.get("tie_word_embeddings", raw.get("tie_word_embeddings"))
    mtp = get("num_nextn_predict_layers", get("num_mtp_layers", 0, int), int)
    cfg = GlmConfig(
        **{name: get(name, getattr(d, name), kind) for name, kind in _SCALARS.items()},
        num_hidden_layers=layers,
        **linear,
        layer_types=_layer_types(raw, layers, src, mtp),
        mlp_layer_types=_mlp_layer_types(raw, layers, src, mtp),
        num_nextn_predict_layers=mtp if _mtp_served[0] or top.get(SERVE_MTP_KEY) else 0,
        **_mtp_kinds(raw, layers, src, mtp),
        indexer_types=_indexer_types(raw, layers, src),
        tie_word_embeddings=bool(tie) if tie is not None else d.tie_word_embeddings,
        has_vision=isinstance(top.get("vision_config"), dict),
        dtype=top.get("dtype") or top.get("torch_dtype") or raw.get("dtype"),
    )
    _check(cfg, src)
    return cfg


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "vocab_size": int,
    "hidden_size": int,
    "intermediate_size": int,
    "moe_intermediate_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "n_shared_experts": int,
    "n_routed_experts": int,
    "routed_scaling_factor": float,
    "kv_lora_rank": int,
    "q_lora_rank": int,
    "qk_rope_head_dim": int,
    "v_head_dim": int,
    "qk_nope_head_dim": int,
    "n_group": int,
    "topk_group": int,
    "num_experts_per_tok": int,
    "norm_topk_prob": bool,
    "hidden_act": str,
    "max_position_embeddings": int,
    "rms_norm_eps": float,
    "attention_bias": bool,
    "index_topk": int,
    "index_head_dim": int,
    "index_n_heads": int,
    "index_kpool": int,
    "index_kpool_always_select_tail": bool,
    "swiglu_limit": float,
    "hc_mult": int,
    "hc_eps": float,
    "hc_sinkhorn_iters": int,
}


def _linear_attn(raw: Mapping[str, Any], d: GlmConfig, source: str) -> dict[str, Any]:
    """The KDA fields, with `linear_attn_config` (as the reference's __post_init__) winning."""
    get = _Fields(raw, source)
    out = {
        "linear_head_dim": get("linear_head_dim", d.linear_head_dim, int),
        "linear_num_heads": get("linear_num_heads", d.linear_num_heads, int),
        "linear_conv_kernel_dim": get("linear_conv_kernel_dim", d.linear_conv_kernel_dim, int),
        "linear_lower_bound": (
            get("linear_lower_bound", None, float)
            if "linear_lower_bound" in raw
            else d.linear_lower_bound
        ),
    }
    extra = raw.get("linear_attn_config")
    if extra is None:
        return out
    if not isinstance(extra, dict):
        raise ConfigError(f"{source}: 'linear_attn_config' must be an object, got {extra!r}")
    sub = _Fields(extra, f"{source} linear_attn_config")
    out["linear_head_dim"] = sub("head_dim", out["linear_head_dim"], int)
    out["linear_num_heads"] = sub("num_heads", out["linear_num_heads"], int)
    kernel = out["linear_conv_kernel_dim"]
    out["linear_conv_kernel_dim"] = sub("short_conv_kernel_size", kernel, int)
    out["linear_lower_bound"] = sub("gate_lower_bound", out["linear_lower_bound"], float)
    if extra.get("safe_gate", True) and out["linear_lower_bound"] is None:
        out["linear_lower_bound"] = -5.0
    return out


def _listed(
    raw: Mapping[str, Any],
    key: str,
    layers: int,
    accepted: tuple[str, ...],
    source: str,
    aliases: Mapping[str, str] | None = None,
    mtp: int = 0,
) -> tuple[str, ...] | None:
    """The list `key` names, num_hidden_layers entries (one more, the MTP layer's, accepted
    when mtp >= 1)."""
    value = raw.get(key)
    if value is None:
        return None
    names = " or ".join(f'"{k}"' for k in accepted)
    lengths = (layers, layers + 1) if mtp > 0 else (layers,)
    if not isinstance(value, list) or len(value) not in lengths:
        more = " (or one more, the MTP layer's)" if mtp > 0 else ""
        raise ConfigError(
            f"{source}: {key!r} must list num_hidden_layers={layers} entries{more}, each "
            f"{names}; got {value!r}"
        )
    value = [(aliases or {}).get(v, v) for v in value]
    bad = sorted({str(v) for v in value if v not in accepted})
    if bad:
        raise ConfigError(
            f"{source}: {key!r} holds {', '.join(map(repr, bad))}; the accepted values are {names}"
        )
    return tuple(value)


_ATTENTION = {"full_attention": MLA}


def _layer_types(raw: Mapping[str, Any], layers: int, source: str, mtp: int = 0) -> tuple[str, ...]:
    listed = _listed(raw, "layer_types", layers, (KDA, MLA), source, _ATTENTION, mtp)
    return listed[:layers] if listed else tuple(MLA if i % 4 == 3 else KDA for i in range(layers))


def _mlp_layer_types(
    raw: Mapping[str, Any], layers: int, source: str, mtp: int = 0
) -> tuple[str, ...]:
    listed = _listed(raw, "mlp_layer_types", layers, (DENSE, SPARSE), source, None, mtp)
    return listed[:layers] if listed else tuple(DENSE if i < 3 else SPARSE for i in range(layers))


def _mtp_kinds(raw: Mapping[str, Any], layers: int, source: str, mtp: int) -> dict[str, str]:
    """The MTP layer's mixer and FFN kinds: a list's extra entry, else MLA and MoE."""
    if mtp < 1:
        return {}
    kinds = _listed(raw, "layer_types", layers, (KDA, MLA), source, _ATTENTION, mtp) or ()
    ffns = _listed(raw, "mlp_layer_types", layers, (DENSE, SPARSE), source, None, mtp) or ()
    return {
        "mtp_layer_type": kinds[layers] if len(kinds) > layers else MLA,
        "mtp_mlp_type": ffns[layers] if len(ffns) > layers else SPARSE,
    }


def _indexer_types(raw: Mapping[str, Any], layers: int, source: str) -> tuple[str, ...]:
    listed = _listed(raw, "indexer_types", layers, (FULL, SHARED), source)
    if listed is not None:
        return listed
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        table = {"F": FULL, "S": SHARED}
        items = list(pattern) if isinstance(pattern, str) else pattern
        mapped = [table.get(p, p) for p in items]
        return (
            _listed(
                {"indexer_types": mapped},
                "indexer_types",
                layers,
                (FULL, SHARED),
                f"{source} index_topk_pattern",
            )
            or ()
        )
    get = _Fields(raw, source)
    freq = max(get("index_topk_freq", 1, int), 1)
    offset = get("index_skip_topk_offset", 2, int)
    return tuple(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(layers))


def _check(cfg: GlmConfig, source: str) -> None:
    positive = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "kv_lora_rank",
        "q_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_topk",
        "index_head_dim",
        "index_n_heads",
        "index_kpool",
        "linear_head_dim",
        "linear_num_heads",
        "linear_conv_kernel_dim",
        "hc_mult",
        "hc_sinkhorn_iters",
        "max_position_embeddings",
    )
    if cfg.num_nextn_predict_layers < 0:
        raise ConfigError(f"{source}: 'num_nextn_predict_layers' must be at least 0")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{source}: {name!r} must be at least 1, got {getattr(cfg, name)}")

    def refuse(message: str) -> None:
        raise ConfigError(f"{source}: {message}")

    if cfg.num_key_value_heads != cfg.num_attention_heads:
        refuse(
            f"num_key_value_heads={cfg.num_key_value_heads} must equal "
            f"num_attention_heads={cfg.num_attention_heads} (as the reference validates)"
        )
    if cfg.qk_rope_head_dim != 0:
        refuse(f"qk_rope_head_dim={cfg.qk_rope_head_dim}: glm5_next's MLA has no RoPE (must be 0)")
    if cfg.index_topk % cfg.index_kpool:
        refuse(f"index_topk={cfg.index_topk} must be a multiple of index_kpool={cfg.index_kpool}")
    if not cfg.index_kpool_always_select_tail:
        refuse(
            "index_kpool_always_select_tail=false is not supported: a query before its first "
            "complete pool would attend to nothing"
        )
    if cfg.hidden_act != "silu":
        refuse(f'hidden_act {cfg.hidden_act!r} is not supported (only "silu")')
    if cfg.linear_conv_kernel_dim < 2:
        refuse(f"linear_conv_kernel_dim={cfg.linear_conv_kernel_dim} must be at least 2")
    for i in cfg.mla_layers:
        if cfg.indexer_types[i] == SHARED and (i == 0 or not cfg.runs_indexer(i - 1)):
            refuse(
                f'layer {i} is a "shared" indexer layer, but layer {i - 1} is not an '
                'indexed_attention layer with a "full" indexer, whose pools it would reuse'
            )
    if any(kind == SPARSE for kind in cfg.mlp_layer_types) or (
        cfg.mtp_layer is not None and cfg.mtp_mlp_type == SPARSE
    ):
        _check_router(cfg, refuse)


def _check_router(cfg: GlmConfig, refuse: Any) -> None:
    experts, groups = cfg.n_routed_experts, cfg.n_group
    if groups < 1 or experts % groups:
        refuse(f"n_routed_experts={experts} must be a multiple of n_group={groups}")
    if groups > 1 and experts // groups < 2:
        refuse(f"each of the n_group={groups} expert groups needs at least 2 experts")
    if not 1 <= cfg.topk_group <= groups:
        refuse(f"topk_group={cfg.topk_group} must be between 1 and n_group={groups}")
    kept = cfg.topk_group * experts // groups
    if not 1 <= cfg.num_experts_per_tok <= kept:
        refuse(
            f"num_experts_per_tok={cfg.num_experts_per_tok} must be between 1 and the "
            f"{kept} experts of the topk_group={cfg.topk_group} kept groups"
        )
