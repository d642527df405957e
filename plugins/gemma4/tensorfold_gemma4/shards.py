"""How Gemma 4 splits across tensor-parallel ranks (the `shard_plan` hook), and a rank's state
layout. Cheap to import: no torch.

- attention: q_proj by heads, k_proj/v_proj by the layer's KV heads (sliding and full layers have
  their own counts; replicated when fewer than ranks, each rank taking the KV head its query
  heads read), o_proj by heads along its input (row-parallel); q_norm/k_norm whole. k_eq_v
  layers take V from k_proj's rows, so their V is the rank's KV heads too. A rank's state: full
  layers page K/V rows [kv_local, D], sliding layers keep rings [W-1, kv_local, D]; KV-shared
  (reuse) layers hold none and read their store layer's rows, the same kind's KV layout.
- dense GeGLU: gate/up by rows, down by columns (row-parallel).
- MoE: the stacked experts (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) by
  expert along dim 0, rank r holding experts block(E, r, world); the router (proj, scale,
  per_expert_scale) and the MoE's norms whole.
- embeddings, per-layer embeddings (PLE) and their projections, norms and layer_scalar whole;
  lm_head vocab-parallel when the vocabulary divides (cut from the tied embeddings as a view,
  or read as a slice of lm_head.weight), else whole.
"""

from __future__ import annotations

from tensorfold.family import (
    COLUMN,
    ROW,
    RowSpec,
    ShardPlan,
    ShardRefused,
    Split,
    StateLayout,
    StateSpec,
)

from .config import FULL, Gemma4Config, Layer

LAYER = r"model\.(?:language_model\.)?layers\.{}"


def kv_local(layer: Layer, world: int) -> int:
    """The KV heads one rank of `world` holds for `layer` (1 when replicated)."""
    return max(1, layer.kv_heads // world)


def ring_specs(layer: Layer, dtype: str, world: int = 1) -> tuple[StateSpec, StateSpec]:
    """The fixed state of a sliding layer that owns its K/V: its K and V rings
    [W-1, kv_local, head_dim] (one rank's KV heads)."""
    assert layer.window is not None and not layer.reuses_kv
    shape = (layer.window - 1, kv_local(layer, world), layer.head_dim)
    name = f"L{layer.index}"
    return (
        StateSpec(f"{name}.sk", shape, dtype, fp8=True),
        StateSpec(f"{name}.sv", shape, dtype, fp8=True),
    )


def state_layout(cfg: Gemma4Config, dtype: str, world: int = 1) -> StateLayout:
    """Each full layer that owns its K/V pages K and V rows [kv_local, head_dim]; each sliding one
    keeps rings of its last W-1 rows a stream as fixed state (sliding.py), which snapshots carry;
    reuse layers read their store layer's rows and hold none. At `world` ranks, one rank's KV
    heads. Any row is a usable mark. The full layers' K/V rows and the rings may be fp8
    (TF_KV_DTYPE)."""
    owners = [layer for layer in cfg.layers if not layer.reuses_kv]
    paged = tuple(
        RowSpec(f"L{layer.index}.{kv}", (kv_local(layer, world), layer.head_dim), dtype, fp8=True)
        for layer in owners
        if layer.window is None
        for kv in ("k", "v")
    )
    fixed: tuple[StateSpec, ...] = tuple(
        spec
        for layer in owners
        if layer.window is not None
        for spec in ring_specs(layer, dtype, world)
    )
    return StateLayout(paged=paged, fixed=fixed, mark_rows=1)


def vocab_parallel(cfg: Gemma4Config, world: int) -> bool:
    return world > 1 and cfg.vocab_size % world == 0


def _kv_field(layer: Layer) -> str:
    if layer.kind != FULL:
        return "num_key_value_heads"
    if layer.k_eq_v:
        return "per_layer_config, or num_global_key_value_heads"
    return "per_layer_config, or num_key_value_heads"


def check(cfg: Gemma4Config, world: int) -> None:
    """Refuse a config whose heads, widths or experts do not cut evenly for `world` ranks."""
    heads = cfg.num_attention_heads
    if heads % world:
        raise ShardRefused(f"gemma4: num_attention_heads={heads} is not a multiple of --tp {world}")
    for layer in cfg.layers:
        kv = layer.kv_heads
        if kv % world and world % kv:
            raise ShardRefused(
                f"gemma4: layer {layer.index} ({layer.kind}) has {kv} KV heads "
                f"({_kv_field(layer)}) and --tp {world}: neither divides the "
                "other"
            )
        if layer.mlp_size % world:
            raise ShardRefused(
                f"gemma4: intermediate_size={cfg.intermediate_size} (layer "
                f"{layer.index}'s MLP is {layer.mlp_size} wide) is not a "
                f"multiple of --tp {world}"
            )
    if cfg.enable_moe_block and cfg.num_experts % world:
        raise ShardRefused(
            f"gemma4: num_experts={cfg.num_experts} is not a multiple of --tp "
            f"{world} (each expert lives on one rank)"
        )


def plan(cfg: Gemma4Config, dtype: str, world: int) -> ShardPlan:
    check(cfg, world)
    heads = cfg.num_attention_heads
    every = LAYER.format(r"\d+")
    attn, mlp = f"{every}\\.self_attn", f"{every}\\.mlp"
    splits: list[tuple[str, Split]] = [
        (f"{attn}\\.q_proj\\.weight", Split(dim=0, parts=heads)),
        (f"{attn}\\.o_proj\\.weight", Split(dim=1, parts=heads)),
        (f"{mlp}\\.(gate|up)_proj\\.weight", COLUMN),
        (f"{mlp}\\.down_proj\\.weight", ROW),
    ]
    if cfg.enable_moe_block:  # stacked [E, ...]: whole experts, block(E, rank, world)
        splits.append(
            (f"{every}\\.experts\\.(gate_up|down)_proj", Split(dim=0, parts=cfg.num_experts))
        )
    for layer in cfg.layers:  # K/V heads differ between sliding and full layers
        if not layer.reuses_kv:
            own = LAYER.format(layer.index)
            splits.append(
                (f"{own}\\.self_attn\\.[kv]_proj\\.weight", Split(dim=0, parts=layer.kv_heads))
            )
    if vocab_parallel(cfg, world):
        splits.append(("lm_head\\.weight", COLUMN))
    return ShardPlan(tuple(splits), state_layout(cfg, dtype, world))
