"""How LFM2-MoE splits across tensor-parallel ranks (the `shard_plan` hook), and a rank's state
layout. Cheap to import: no torch.

- attention: q by heads, k/v by KV heads (replicated when fewer than ranks), out_proj by heads
  along its input (row-parallel); q/k layernorms whole. A rank's K/V rows: its KV heads.
- short conv: in_proj's B, C and x sections by channels, the depthwise conv by channels,
  out_proj by channels along its input (row-parallel, its bias added once after the sum). A
  rank's conv tail: its channels.
- dense FFN: w1/w3 by rows, w2 by columns. MoE: the router and expert bias whole, each expert
  whole on one rank (experts e in block(E, rank, world)).
- embeddings and norms whole; lm_head vocab-parallel when the vocabulary divides (cut from the
  tied embeddings as a view, or read as a slice of lm_head.weight), else whole.
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

from .config import Lfm2MoeConfig

LAYER = r"model\.layers\.\d+"


def state_layout(cfg: Lfm2MoeConfig, dtype: str, world: int = 1) -> StateLayout:
    """Attention layers page K and V rows [kv_heads, head_dim]; conv layers keep their tail
    (the last K-1 values of B⊙x) per stream, [H, K-1]; at `world` ranks, one rank's heads and
    channels. Any row is a usable mark. K/V rows may be fp8 (TF_KV_DTYPE)."""
    kv = max(1, cfg.num_key_value_heads // world)
    row = (kv, cfg.head_dim)
    paged = tuple(
        RowSpec(f"L{i}.{n}", row, dtype, fp8=True) for i in cfg.attention_layers for n in ("k", "v")
    )
    tail = (cfg.hidden_size // world, cfg.conv_L_cache - 1)
    fixed = tuple(StateSpec(f"L{i}.conv", tail, dtype) for i in cfg.conv_layers)
    return StateLayout(paged=paged, fixed=fixed, mark_rows=1)


def vocab_parallel(cfg: Lfm2MoeConfig, world: int) -> bool:
    return cfg.vocab_size % world == 0


def check(cfg: Lfm2MoeConfig, world: int) -> None:
    """Refuse a config whose heads, channels or experts do not cut evenly for `world` ranks."""
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    if heads % world:
        raise ShardRefused(
            f"lfm2_moe: num_attention_heads={heads} is not a multiple of --tp {world}"
        )
    if kv % world and world % kv:
        raise ShardRefused(
            f"lfm2_moe: num_key_value_heads={kv} and --tp {world}: neither divides the other"
        )
    if cfg.hidden_size % world:
        raise ShardRefused(
            f"lfm2_moe: hidden_size={cfg.hidden_size} (the short conv's "
            f"channels) is not a multiple of --tp {world}"
        )
    if cfg.num_dense_layers and cfg.intermediate_size % world:
        raise ShardRefused(
            f"lfm2_moe: intermediate_size={cfg.intermediate_size} is not a multiple of --tp {world}"
        )
    if cfg.num_dense_layers < cfg.num_hidden_layers and cfg.num_experts % world:
        raise ShardRefused(
            f"lfm2_moe: num_experts={cfg.num_experts} is not a multiple of --tp "
            f"{world} (each expert lives on one rank)"
        )


def plan(cfg: Lfm2MoeConfig, dtype: str, world: int) -> ShardPlan:
    check(cfg, world)
    attn, conv, ffn = f"{LAYER}\\.self_attn", f"{LAYER}\\.conv", f"{LAYER}\\.feed_forward"
    splits: list[tuple[str, Split]] = [
        (f"{attn}\\.q_proj\\.weight", Split(dim=0, parts=cfg.num_attention_heads)),
        (f"{attn}\\.[kv]_proj\\.weight", Split(dim=0, parts=cfg.num_key_value_heads)),
        (f"{attn}\\.out_proj\\.weight", Split(dim=1, parts=cfg.num_attention_heads)),
        (f"{conv}\\.in_proj\\.(weight|bias)", Split(dim=0, groups=3)),
        (f"{conv}\\.conv\\.(weight|bias)", COLUMN),
        (f"{conv}\\.out_proj\\.weight", ROW),
        (f"{ffn}\\.w[13]\\.weight", COLUMN),
        (f"{ffn}\\.w2\\.weight", ROW),
        (f"{ffn}\\.experts\\.(?P<expert>\\d+)\\.w[123]\\.weight", Split(experts=cfg.num_experts)),
    ]
    if vocab_parallel(cfg, world):
        splits.append(("lm_head\\.weight", COLUMN))
    return ShardPlan(tuple(splits), state_layout(cfg, dtype, world))
