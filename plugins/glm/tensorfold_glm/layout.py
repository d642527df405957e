"""What a glm5_next stream keeps, from config.json alone (no torch, no weights).

Paged, per token and MLA layer: the normed KV latent `c` [kv_lora_rank] (what MLA attends over),
and for a layer with its own indexer the indexer key `kI` [index_head_dim], the compression-gate
score `gI` [index_head_dim] and the pool key `pool_key` [index_head_dim]: the GPU path keeps pool
p's key K_p (in the model dtype, the bits its scoring multiplies) at the row of the pool's last
position kpool·p + kpool - 1, written once by the pass that writes that row; the CPU path
rebuilds the pooled keys from kI and gI in every pass, as the reference does, and leaves it
unwritten.
Fixed, per KDA layer: the fp32 recurrent state [heads, K, V] and the conv tail, the last K-1
pre-conv q|k|v rows [3 * heads * head_dim, K-1] in the model dtype.
The MTP layer (config.mtp_layer, when config.json declares one, at one rank only) keeps the same
as a layer of its kind, under its own index: an MLA one its latent and indexer rows (its row j
reads the token at position j, mtp.py), a KDA one its recurrent state and conv tail; and a
fixed `L{N}.carry` [hidden_size] in the model dtype: the trunk's hidden state of the stream's
last row fed, which the MTP's next row reads (written and tapped by the trunk's forward, so a
kept prompt resumes with it). It is in the layout whether or not the weights carry the layer,
since the plan reads config.json alone.

Under tensor parallel (`world` ranks, shards.py) a rank keeps its KDA heads' states
(heads/world, K, V) and its channels' conv tail (3 * heads * head_dim / world, K-1); the MLA
latent and the indexer rows (pool keys included) are whole on every rank.

Marks are multiples of lcm(KDA_CHUNK, index_kpool) (64 at the real shape): the GPU path runs a
prompt's whole 64-row KDA chunks through fla-core's chunked kernel, whose state is the same bits
only at chunk boundaries (kda_launches.py), and a kept prompt ending on a pool boundary holds
the cached key of every pool it completed. The lanes cut prompts on the same grid. (The CPU
path's token-by-token recurrence would be exact anywhere; both paths take the same marks.)
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from tensorfold.family import ModelShape, RowSpec, StateLayout, StateSpec

from .config import MLA, GlmConfig
from .vision_memory import tower_bytes_for_config

KDA_CHUNK = 64  # fla-core chunk_kda's chunk

DTYPES = ("float32", "bfloat16", "float16")


def shape(config: Mapping[str, Any], dtype: str = "bfloat16") -> ModelShape:
    """The memory plan's view of a checkpoint, from config.json alone: the state layout, the
    window, and the vision tower's activations at the largest image (vision_memory.py)."""
    cfg = GlmConfig.from_dict(config, "config.json")
    media = tower_bytes_for_config(config, dtype)
    return ModelShape(state_layout(cfg, dtype), cfg.max_position_embeddings, media_bytes=media)


def carry_name(cfg: GlmConfig) -> str:
    """The fixed state holding the hidden state the MTP layer's next row reads."""
    return f"L{cfg.mtp_layer}.carry"


def state_layout(cfg: GlmConfig, dtype: str, world: int = 1) -> StateLayout:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"glm5_next runs in {', '.join(DTYPES)}, not {dtype!r}")
    mtp = cfg.mtp_layer if world == 1 else None
    mla_layers, kda_layers = cfg.mla_layers, cfg.kda_layers
    if mtp is not None:
        if cfg.mtp_layer_type == MLA:
            mla_layers += (mtp,)
        else:
            kda_layers += (mtp,)
    paged: list[RowSpec] = []
    for i in mla_layers:
        paged.append(RowSpec(f"L{i}.latent", (cfg.kv_lora_rank,), name, fp8=True))
        if i == mtp or cfg.runs_indexer(i):
            paged.append(RowSpec(f"L{i}.index_k", (cfg.index_head_dim,), name))
            paged.append(RowSpec(f"L{i}.index_gate", (cfg.index_head_dim,), name))
            paged.append(RowSpec(f"L{i}.pool_key", (cfg.index_head_dim,), name))
    heads, dim = cfg.linear_num_heads // world, cfg.linear_head_dim
    tail = (3 * cfg.kda_dim // world, cfg.linear_conv_kernel_dim - 1)
    fixed: list[StateSpec] = []
    for i in kda_layers:
        fixed.append(StateSpec(f"L{i}.kda", (heads, dim, dim), "float32", arena_taps=True))
        fixed.append(StateSpec(f"L{i}.conv", tail, name))
    if mtp is not None:
        fixed.append(StateSpec(carry_name(cfg), (cfg.hidden_size,), name))
    return StateLayout(
        paged=tuple(paged), fixed=tuple(fixed), mark_rows=math.lcm(KDA_CHUNK, cfg.index_kpool)
    )
