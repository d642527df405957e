"""LFM2-MoE at a real model's shape with random weights made in place on the device from a fixed
seed, as vLLM's `--load-format dummy`: for benchmarks, with no checkpoint to read.

Weights are drawn from N(0, std²) (norm weights 1, the expert bias small), one tensor at a time on
`device` from a generator seeded once. Each MoE layer's experts live in two stacked tensors, laid
out as transformers keeps them (gate_up [E, 2I, H] holding w1 then w3, down [E, H, I]); the
per-expert weights are views into them, so the grouped kernels use them without a copy.
"""

from __future__ import annotations

import torch

from tensorfold.engine.dummy_draws import dummy_lm_head, rank_draws
from tensorfold.family import Shard, block
from tensorfold.ops import parallel
from tensorfold.ops.fp8 import quantize_blocks

from . import shards
from .config import ATTENTION, CONV, Lfm2MoeConfig
from .model import Lfm2MoeModel
from .weights import (
    AttentionWeights,
    ConvWeights,
    DenseWeights,
    LayerWeights,
    ModelWeights,
    MoeWeights,
)


def _layer_types(layers: int, attention: tuple[int, ...]) -> tuple[str, ...]:
    return tuple(ATTENTION if i in attention else CONV for i in range(layers))


# From the model cards: LFM2-8B-A1B has 24 layers (18 conv + 6 attention), 32 experts top-4 of
# width 1792, a dense width of 7168, the first 2 layers dense (8.34B parameters, 1.56B active);
# LFM2-24B-A2B has 40 layers (30 conv + 10 attention), 64 experts top-4 of width 1536, the first
# 2 dense, a 32K context (23.8B, 2.27B active). The 8B's attention layers are a third-party
# listing; the 24B's are not published: every fourth layer from 2, as the 8B's spacing.
SHAPES: dict[str, Lfm2MoeConfig] = {
    "LFM2-8B-A1B": Lfm2MoeConfig(
        num_hidden_layers=24,
        layer_types=_layer_types(24, (2, 6, 10, 14, 18, 21)),
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=1792,
        intermediate_size=7168,
        num_dense_layers=2,
        eos_token_ids=(7,),
    ),
    "LFM2-24B-A2B": Lfm2MoeConfig(
        num_hidden_layers=40,
        layer_types=_layer_types(40, tuple(range(2, 40, 4))),
        num_experts=64,
        num_experts_per_tok=4,
        moe_intermediate_size=1536,
        intermediate_size=7168,
        num_dense_layers=2,
        max_position_embeddings=32768,
        eos_token_ids=(7,),
    ),
}


def dummy_weights(
    cfg: Lfm2MoeConfig,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
    fp8: bool = False,
) -> ModelWeights:
    """fp8: each layer's linears quantized (`quantize_layer`) as soon as it is drawn, so the
    peak holds one layer in `dtype` beside the fp8 rest.

    Under tensor parallel (tensorfold.ops.parallel.current()), this rank's shard as shards.py
    cuts it: replicated tensors drawn alike on every rank, its slices from a generator of its
    own."""
    tp = parallel.current()
    world = tp.world
    if world > 1:
        shards.check(cfg, world)
    init, part = rank_draws(device, dtype, seed, std)  # replicated; this rank's slices
    h, d = cfg.hidden_size, cfg.head_dim
    hl = h // world  # this rank's conv channels
    embed = init.normal(cfg.vocab_size, h)
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == ATTENTION:
            q = cfg.num_attention_heads // world * d
            kv = max(1, cfg.num_key_value_heads // world) * d
            mixer: AttentionWeights | ConvWeights = AttentionWeights(
                part.normal(q, h),
                part.normal(kv, h),
                part.normal(kv, h),
                part.normal(h, q),
                init.ones(d),
                init.ones(d),
            )
        else:
            bias = cfg.conv_bias
            mixer = ConvWeights(
                part.normal(3 * hl, h),
                part.normal(3 * hl) if bias else None,
                part.normal(hl, cfg.conv_L_cache, std=0.3),
                part.normal(hl) if bias else None,
                part.normal(h, hl),
                init.normal(h) if bias else None,
            )
        if cfg.is_dense(i):
            n = cfg.intermediate_size // world
            ffn: DenseWeights | MoeWeights = DenseWeights(
                part.normal(n, h), part.normal(n, h), part.normal(h, n)
            )
        else:
            e, n = cfg.num_experts, cfg.moe_intermediate_size
            local = Shard(tp.rank, world).experts(e)
            gate_up = part.normal(len(local), 2 * n, h)
            down = part.normal(len(local), h, n)
            bias_e = init.normal(e, std=0.01, dtype=torch.float32) if cfg.use_expert_bias else None
            ffn = MoeWeights(  # [E, I, H] views of the stacks, as the loader's stacked tensors
                init.normal(e, h),
                bias_e,
                gate_up[:, :n],
                gate_up[:, n:],
                down,
                local.start,
            )
        layer = LayerWeights(init.ones(h), init.ones(h), mixer, ffn)
        layers.append(quantize_layer(layer) if fp8 else layer)
    split_vocab = world > 1 and shards.vocab_parallel(cfg, world)
    vocab = block(cfg.vocab_size, tp.rank, world) if split_vocab else None
    lm_head = dummy_lm_head(init, part, embed, True, vocab)  # tied, as the published LFM2 models
    return ModelWeights(embed, init.ones(h), lm_head, layers)


def quantize_layer(layer: LayerWeights) -> LayerWeights:
    """--quantization fp8 on a dummy layer, in place: the linears weights.py reads with
    `read.linear` quantized to 128 x 128 blocks as the loader quantizes them (q, k and v apart,
    then joined; each expert stack a matrix at a time)."""
    m, f = layer.mixer, layer.ffn
    if isinstance(m, AttentionWeights):
        q, k, v, out = (quantize_blocks(t) for t in (m.q, m.k, m.v, m.out))
        layer.mixer = AttentionWeights(q, k, v, out, m.q_norm, m.k_norm)
    else:
        m.in_proj, m.out_proj = quantize_blocks(m.in_proj), quantize_blocks(m.out_proj)
    if isinstance(f, DenseWeights):
        f.w1, f.w3, f.w2 = (quantize_blocks(t) for t in (f.w1, f.w3, f.w2))
    else:
        stacks = (
            t if isinstance(t, torch.Tensor) else torch.stack(list(t)) for t in (f.w1, f.w3, f.w2)
        )
        f.w1, f.w3, f.w2 = (quantize_blocks(t) for t in stacks)
    return layer


def build_dummy(
    shape: str | Lfm2MoeConfig,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    quantization: str = "auto",
) -> Lfm2MoeModel:
    """A model at `shape` (a name in SHAPES, or a config) with dummy weights on `device`; its
    linears in fp8 with quantization="fp8" (`quantize_layer`)."""
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    weights = dummy_weights(cfg, device, dtype, seed, std, fp8=quantization == "fp8")
    return Lfm2MoeModel(cfg, weights, device, dtype)


def load_dummy(config: dict, device: str, dtype: str, quantization: str = "auto") -> Lfm2MoeModel:
    """TF_LOAD_FORMAT=dummy: the checkpoint's config.json with random weights (fp8 linears under
    --quantization fp8)."""
    from tensorfold.family.checkpoint import torch_dtype

    cfg = Lfm2MoeConfig.from_dict(config)
    return build_dummy(cfg, device, torch_dtype(dtype), quantization=quantization)


def expert_stacks(w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """A dummy MoE layer's (gate_up [E, 2I, H], down [E, H, I]), the tensors its views share."""
    e, (n, h) = len(w.w1), w.w1[0].shape
    first = w.w1[0]
    gate_up = first.as_strided((e, 2 * n, h), (2 * n * h, h, 1), first.storage_offset())
    down = w.w2[0].as_strided((e, h, n), (h * n, n, 1), w.w2[0].storage_offset())
    return gate_up, down


def cast(model: Lfm2MoeModel, dtype: torch.dtype) -> Lfm2MoeModel:
    """A copy of a dummy model in another dtype (the expert bias stays fp32), its experts
    stacked as build_dummy makes them."""
    w = model.weights

    def c(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dtype)

    layers = []
    for layer in w.layers:
        m, f = layer.mixer, layer.ffn
        if isinstance(m, AttentionWeights):
            mixer: AttentionWeights | ConvWeights = AttentionWeights(
                *(c(t) for t in (m.q, m.k, m.v, m.out, m.q_norm, m.k_norm))  # type: ignore[misc]
            )
        else:
            mixer = ConvWeights(
                *(c(t) for t in (m.in_proj, m.in_bias, m.conv, m.conv_bias, m.out_proj, m.out_bias))
            )  # type: ignore[arg-type]
        if isinstance(f, DenseWeights):
            ffn: DenseWeights | MoeWeights = DenseWeights(c(f.w1), c(f.w3), c(f.w2))  # type: ignore[arg-type]
        else:
            gate_up, down = (t.to(dtype) for t in expert_stacks(f))
            n = f.w1[0].shape[0]
            ffn = MoeWeights(
                c(f.gate), f.expert_bias, gate_up[:, :n], gate_up[:, n:], down, f.first_expert
            )
        layers.append(LayerWeights(c(layer.operator_norm), c(layer.ffn_norm), mixer, ffn))  # type: ignore[arg-type]
    embed = c(w.embed)
    lm_head = embed if w.lm_head is w.embed else c(w.lm_head)
    weights = ModelWeights(embed, c(w.final_norm), lm_head, layers)  # type: ignore[arg-type]
    return Lfm2MoeModel(model.cfg, weights, str(model.device), dtype)
