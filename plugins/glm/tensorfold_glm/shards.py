"""How glm5_next splits across tensor-parallel ranks (the `shard_plan` hook). Cheap to import: no
torch.

- KDA: q/k/v_proj, the q/k/v convolutions, f_b/g_b_proj, dt_bias, A_log and b_proj by heads
  (linear_num_heads) along their output rows; o_proj by heads along its input (row-parallel);
  f_a/g_a_proj and o_norm whole. A rank's state: its heads' recurrent state
  (heads/world, K, V) fp32 and its channels' conv tail (3·D/world, K-1).
- MLA: q_a/kv_a_proj_with_mqa (and their biases and norms) whole, so the paged latent row
  (kv_lora_rank,) is the same on every rank; q_b_proj and kv_b_proj by heads
  (num_attention_heads) along their rows; o_proj by heads along its input, its bias added once
  after the sum.
- the indexer, the mHC weights, embeddings and norms whole: every rank scores and picks the same
  pools (the residual is the same on every rank after each sum) and mixes the same streams;
  the indexer's rows are paged on every rank.
- FFN: dense gate/up by rows, down by columns; MoE: the router and its correction bias whole,
  each routed expert whole on one rank (block(E, rank, world)), the shared expert as a dense
  FFN.
- lm_head (untied) vocab-parallel when the vocabulary divides, else whole; a tied one is cut
  from the embeddings as a view.
"""

from __future__ import annotations

from tensorfold.family import COLUMN, ROW, ShardPlan, ShardRefused, Split

from .config import DENSE, SPARSE, GlmConfig
from .layout import state_layout

ROOT = r"model\.(?:language_model\.)?layers\."


def _layers(ids: tuple[int, ...]) -> str:
    """A pattern matching the layer prefix of exactly these layers (never the MTP layer's)."""
    return f"{ROOT}(?:{'|'.join(map(str, ids))})\\."


def vocab_parallel(cfg: GlmConfig, world: int) -> bool:
    return world > 1 and cfg.vocab_size % world == 0


def check(cfg: GlmConfig, world: int) -> None:
    """Refuse a config whose heads, FFN widths or experts do not cut evenly for `world` ranks,
    naming the config field."""

    def need(field: str, value: int, what: str) -> None:
        if value % world:
            raise ShardRefused(
                f"glm5_next: {field}={value} ({what}) is not a multiple of --tp {world}"
            )

    if cfg.kda_layers:
        need("linear_num_heads", cfg.linear_num_heads, "the KDA heads")
    if cfg.mla_layers:
        need("num_attention_heads", cfg.num_attention_heads, "the MLA heads")
    if DENSE in cfg.mlp_layer_types:
        need("intermediate_size", cfg.intermediate_size, "the dense FFN's width")
    if SPARSE in cfg.mlp_layer_types:
        need("n_routed_experts", cfg.n_routed_experts, "each expert lives on one rank")
        need(
            "moe_intermediate_size * n_shared_experts",
            cfg.moe_intermediate_size * cfg.n_shared_experts,
            "the shared expert's width",
        )


def plan(cfg: GlmConfig, dtype: str, world: int) -> ShardPlan:
    check(cfg, world)
    splits: list[tuple[str, Split]] = []
    if cfg.kda_layers:
        a, heads = _layers(cfg.kda_layers) + r"self_attn\.", cfg.linear_num_heads
        by_heads = Split(dim=0, parts=heads)
        splits += [
            (a + r"[qkv]_proj\.weight", by_heads),
            (a + r"[qkv]_conv1d\.weight", by_heads),
            (a + r"[fg]_b_proj\.weight", by_heads),
            (a + r"(?:dt_bias|A_log|b_proj\.weight)", by_heads),
            (a + r"o_proj\.weight", Split(dim=1, parts=heads)),
        ]
    if cfg.mla_layers:
        a, heads = _layers(cfg.mla_layers) + r"self_attn\.", cfg.num_attention_heads
        splits += [
            (a + r"(?:q_b_proj|kv_b_proj)\.weight", Split(dim=0, parts=heads)),
            (a + r"o_proj\.weight", Split(dim=1, parts=heads)),
        ]
    dense = tuple(i for i, kind in enumerate(cfg.mlp_layer_types) if kind == DENSE)
    sparse = tuple(i for i, kind in enumerate(cfg.mlp_layer_types) if kind == SPARSE)
    if dense:
        m = _layers(dense) + r"mlp\."
        splits += [(m + r"(?:gate|up)_proj\.weight", COLUMN), (m + r"down_proj\.weight", ROW)]
    if sparse:
        m = _layers(sparse) + r"mlp\."
        splits += [
            (
                m + r"experts\.(?P<expert>\d+)\.(?:gate|up|down)_proj\.weight",
                Split(experts=cfg.n_routed_experts),
            ),
            (m + r"shared_experts\.(?:gate|up)_proj\.weight", COLUMN),
            (m + r"shared_experts\.down_proj\.weight", ROW),
        ]
    if vocab_parallel(cfg, world):
        splits.append((r"lm_head\.weight", COLUMN))
    return ShardPlan(tuple(splits), state_layout(cfg, str(dtype), world))
