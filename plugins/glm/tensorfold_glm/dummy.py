"""GLM-5.3-Flash's text model at a real shape with random weights made in place on the device from
a fixed seed, as vLLM's `--load-format dummy`: for benchmarks, with no checkpoint to read.

Weights are drawn from N(0, std²) one tensor at a time on `device` from a generator seeded once;
norm weights are ones. The tensors the real loader keeps in fp32 are fp32 here too (A_log,
dt_bias, the conv weights, the mHC base/scale, e_score_correction_bias), and those it upcasts
(the mHC fn, the router) are drawn in the model dtype and upcast. Each MoE layer's experts live
in two stacked tensors (gate_up [E, 2I, H], gate rows first, and down [E, H, I]); the per-expert
weights are views into them. The scales keep bf16 activations finite through mHC, KDA and MLA:
the mHC projection's logits stay O(1), A_log spans exp(A) in [1, 16] as the reference's init.

Under tensor parallel (tensorfold.ops.parallel.current()) each rank draws its shard as shards.py
cuts it: replicated tensors from the seeded generator (alike on every rank), its slices and its
experts from a generator of its own, in the order one rank draws them. At one rank both are one
generator, and the draws are those of a model with no tensor parallel.
"""

from __future__ import annotations

import math

import torch

from tensorfold.engine.dummy_draws import Draws, dummy_lm_head, rank_draws
from tensorfold.family import Shard, block
from tensorfold.ops import parallel
from tensorfold.ops.fp8 import Fp8Weight, cat_rows, empty_stack, put, quantize_blocks

from . import shards
from .config import DENSE, KDA, GlmConfig
from .model import GlmModel
from .weights import (
    DenseWeights,
    HcWeights,
    IndexerWeights,
    KdaWeights,
    LayerWeights,
    MlaWeights,
    ModelWeights,
    MoeWeights,
)

F32 = torch.float32

# The class defaults of Glm5NextTextConfig (transformers 5.23.0): vocab 154880, H 4096, 45
# layers, every fourth from 3 MLA with its own indexer and the rest KDA (34 KDA + 11 MLA), 3 dense
# (12288) + 42 MoE (288 experts of 2048, top-8, one shared); 313.3B text parameters;
# "-8L" keeps the widths with 8 layers: KDA but at 3 and 7 (MLA), 3 dense + 5 MoE, ~76 GB bf16.
SHAPES: dict[str, GlmConfig] = {
    "GLM-5.3-Flash": GlmConfig.from_dict({}, "GLM-5.3-Flash"),
    "GLM-5.3-Flash-8L": GlmConfig.from_dict({"num_hidden_layers": 8}, "GLM-5.3-Flash-8L"),
}


def _hc(init: Draws, cfg: GlmConfig) -> HcWeights:
    n = cfg.hc_mult
    width = (2 + n) * n
    # f is RMS-normed over hc·H: logits f·fn have std ≈ sqrt(hc·H)·std_fn = 0.5.
    std_fn = 0.5 / math.sqrt(n * cfg.hidden_size)
    return HcWeights(
        fn=init.normal(width, n * cfg.hidden_size, std=std_fn).float(),
        base=init.normal(width, std=0.5, dtype=F32),
        scale=init.uniform(3, low=0.5, high=1.5),
    )


def _kda(init: Draws, part: Draws, cfg: GlmConfig, world: int) -> KdaWeights:
    """part: this rank's heads (heads, d: one rank's)."""
    h, dk = cfg.hidden_size, cfg.linear_head_dim
    heads, d = cfg.linear_num_heads // world, cfg.kda_dim // world
    a_log = torch.log(part.uniform(heads, low=1.0, high=16.0))
    return KdaWeights(
        qkv=part.normal(3 * d, h),
        conv=part.normal(3 * d, cfg.linear_conv_kernel_dim, std=0.3, dtype=F32),
        f_a=init.normal(dk, h),
        f_b=part.normal(d, dk),
        dt_bias=part.normal(d, std=0.5, dtype=F32),
        decay=torch.exp(a_log),
        a_log=a_log,
        b=part.normal(heads, h),
        g_a=init.normal(dk, h),
        g_b=part.normal(d, dk),
        o_norm=init.ones(dk),
        o=part.normal(h, d),
    )


def _mla(init: Draws, part: Draws, cfg: GlmConfig, indexer: bool, world: int) -> MlaWeights:
    """part: this rank's heads of q_b, w_uk, w_uv and o; the rest (the indexer) replicated."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads // world
    qr, r, dn, dv = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    bias = cfg.attention_bias
    idx = None
    if indexer:
        n, di = cfg.index_n_heads, cfg.index_head_dim
        idx = IndexerWeights(
            wq_b=init.normal(n * di, qr),
            wk=init.normal(di, h),
            k_norm=init.ones(di),
            k_bias=init.zeros(di),
            weights_proj=init.normal(n, h),
            ape=init.normal(cfg.index_kpool, di, std=0.5),
            gate=init.normal(di, h),
        )
    return MlaWeights(
        q_a=init.normal(qr, h),
        q_a_bias=init.zeros(qr) if bias else None,
        q_a_norm=init.ones(qr),
        q_b=part.normal(heads * dn, qr),
        kv_a=init.normal(r, h),
        kv_a_bias=init.zeros(r) if bias else None,
        kv_a_norm=init.ones(r),
        w_uk=part.normal(heads, r, dn),
        w_uv=part.normal(heads, dv, r),
        o=part.normal(h, heads * dv),
        o_bias=init.zeros(h) if bias else None,
        indexer=idx,
    )


def _dense(init: Draws, h: int, width: int) -> DenseWeights:
    return DenseWeights(init.normal(2 * width, h), init.normal(h, width))


def _moe(init: Draws, part: Draws, cfg: GlmConfig, local: range, world: int) -> MoeWeights:
    """part: this rank's experts (`local`, views of its stacks) and its shared-expert columns."""
    h, e, width = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    gate_up = part.normal(len(local), 2 * width, h)
    down = part.normal(len(local), h, width)
    experts = [DenseWeights(gu, dn) for gu, dn in zip(gate_up.unbind(0), down.unbind(0))]
    return MoeWeights(
        router=init.normal(e, h).float(),
        bias=init.normal(e, std=0.01, dtype=F32),
        experts=experts,
        shared=_dense(part, h, width * cfg.n_shared_experts // world),
        first_expert=local.start,
    )


def dummy_weights(
    cfg: GlmConfig,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
    fp8: bool = False,
) -> ModelWeights:
    """fp8: each layer's linears quantized (`quantize_layer`) as soon as it is drawn, so the
    peak holds one layer in `dtype` beside the fp8 rest (GLM-8L's fits an H100)."""
    tp = parallel.current()
    world = tp.world
    if world > 1:
        shards.check(cfg, world)
    init, part = rank_draws(device, dtype, seed, std)  # replicated; this rank's slices
    sparse = any(kind != DENSE for kind in cfg.mlp_layer_types)
    local = Shard(tp.rank, world).experts(cfg.n_routed_experts) if sparse else range(0)
    h = cfg.hidden_size
    embed = init.normal(cfg.vocab_size, h)
    layers = []
    for i, kind in enumerate(cfg.layer_types):
        mixer = (
            _kda(init, part, cfg, world)
            if kind == KDA
            else _mla(init, part, cfg, cfg.runs_indexer(i), world)
        )
        ffn = (
            _dense(part, h, cfg.intermediate_size // world)
            if cfg.mlp_layer_types[i] == DENSE
            else _moe(init, part, cfg, local, world)
        )
        layer = LayerWeights(
            attn_hc=_hc(init, cfg),
            ffn_hc=_hc(init, cfg),
            input_norm=init.ones(h),
            post_norm=init.ones(h),
            mixer=mixer,
            ffn=ffn,
        )
        layers.append(quantize_layer(layer) if fp8 else layer)
    vocab = block(cfg.vocab_size, tp.rank, world) if shards.vocab_parallel(cfg, world) else None
    lm_head = dummy_lm_head(init, part, embed, cfg.tie_word_embeddings, vocab)
    return ModelWeights(embed, init.ones(h), lm_head, layers)


def _fp8_rows(t: torch.Tensor, parts: int) -> Fp8Weight | torch.Tensor:
    """A joined weight quantized as the loader quantizes its parts (each apart, then joined)."""
    return cat_rows([quantize_blocks(p) for p in t.chunk(parts)])


def _fp8_dense(w: DenseWeights) -> DenseWeights:
    return DenseWeights(_fp8_rows(w.gate_up, 2), quantize_blocks(w.down))


def quantize_layer(layer: LayerWeights) -> LayerWeights:
    """--quantization fp8 on a dummy layer, in place: the linears weights.py reads with
    `read.linear` quantized to 128 x 128 blocks as the loader quantizes them (q, k and v apart,
    gate and up apart, then joined; the experts one at a time into fp8 stacks)."""
    m = layer.mixer
    if isinstance(m, KdaWeights):
        fp8 = {n: quantize_blocks(getattr(m, n)) for n in ("f_a", "f_b", "b", "g_a", "g_b", "o")}
        plain = {n: getattr(m, n) for n in ("conv", "dt_bias", "decay", "a_log", "o_norm")}
        layer.mixer = KdaWeights(qkv=_fp8_rows(m.qkv, 3), **fp8, **plain)
    else:
        m.q_a, m.q_b, m.kv_a, m.o = (quantize_blocks(t) for t in (m.q_a, m.q_b, m.kv_a, m.o))
    f = layer.ffn
    if isinstance(f, DenseWeights):
        layer.ffn = _fp8_dense(f)
        return layer
    f.shared = _fp8_dense(f.shared)
    gate_up = down = None
    for e, expert in enumerate(f.experts):
        one = _fp8_dense(expert)
        if gate_up is None or down is None:
            gate_up = empty_stack(one.gate_up, len(f.experts))
            down = empty_stack(one.down, len(f.experts))
        put(gate_up, e, one.gate_up)
        put(down, e, one.down)
    if gate_up is not None and down is not None:
        f.experts = [DenseWeights(gate_up[e], down[e]) for e in range(len(f.experts))]
    return layer


def build_dummy(
    shape: str | GlmConfig,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    quantization: str = "auto",
) -> GlmModel:
    """A model at `shape` (a name in SHAPES, or a config) with dummy weights on `device`; its
    linears in fp8 with quantization="fp8" (`quantize_layer`)."""
    cfg = SHAPES[shape] if isinstance(shape, str) else shape
    name = str(dtype).removeprefix("torch.")
    weights = dummy_weights(cfg, device, dtype, seed, std, fp8=quantization == "fp8")
    return GlmModel(cfg, weights, device, name)


def load_dummy(config: dict, device: str, dtype: str, quantization: str = "auto") -> GlmModel:
    """TF_LOAD_FORMAT=dummy: the checkpoint's config.json with random weights (fp8 linears under
    --quantization fp8), and a random vision tower (vision_dummy.py, in the model dtype) where
    config.json has a vision_config, so a dummy model takes images as the checkpoint would."""
    from tensorfold.family.checkpoint import torch_dtype

    from .vision_config import VisionConfig
    from .vision_dummy import dummy_vision_weights

    cfg = GlmConfig.from_dict(config)
    model = build_dummy(cfg, device, torch_dtype(dtype), quantization=quantization)
    raw = config.get("vision_config")
    if isinstance(raw, dict):
        vision = VisionConfig.from_dict(raw, "config.json (vision_config)")
        if vision.out_hidden_size != cfg.hidden_size:
            raise ValueError(
                f"config.json: the vision tower's out_hidden_size {vision.out_hidden_size} is "
                f"not the text hidden_size {cfg.hidden_size}"
            )
        model.vision = dummy_vision_weights(vision, device, torch_dtype(dtype), seed=1)
    return model


def expert_stacks(w: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """A dummy MoE layer's (gate_up [E, 2I, H], down [E, H, I]), the tensors its views share."""
    e = len(w.experts)
    gu, dn = w.experts[0].gate_up, w.experts[0].down
    (n2, h), (_, n) = gu.shape, dn.shape
    return (
        gu.as_strided((e, n2, h), (n2 * h, h, 1), gu.storage_offset()),
        dn.as_strided((e, h, n), (h * n, n, 1), dn.storage_offset()),
    )
