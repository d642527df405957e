"""Gemma 4 at a real model's shape with random weights made in place on the device from a fixed
seed, as vLLM's `--load-format dummy`: for benchmarks, with no checkpoint to read.

Weights are drawn from N(0, std²) one tensor at a time on `device` from a generator seeded once.
Norm weights are 1 + N(0, 0.1²) rounded to the model dtype and kept in fp32 (as weights.py keeps
them); the router is drawn wide (std 1) so its top-k choices are not near ties; layer_scalar,
router.scale and per_expert_scale are 1. With every sublayer's output normed before it joins the
residual, activations stay of order one in bf16. Experts are stacked as transformers and the
checkpoints keep them: gate_up [E, 2I, H] (gate rows first), down [E, H, I].

Under tensor parallel (tensorfold.ops.parallel.current()) each rank draws its shard as shards.py
cuts it: replicated tensors alike on every rank, its slices (heads, channels, experts, its
vocabulary of an untied lm_head) from a generator of its own. At one rank the draws are those
of a single process.
"""

from __future__ import annotations

from typing import Any

import torch

from tensorfold.engine.dummy_draws import dummy_lm_head, rank_draws
from tensorfold.family import Shard, block
from tensorfold.ops import parallel
from tensorfold.ops.fp8 import Fp8Weight, quantize_blocks

from . import shards
from .audio_config import AudioConfig, audio_config
from .audio_weights import AudioLayerWeights, AudioWeights, FeedForwardWeights
from .config import DEFAULT_ROPE, FULL, SLIDING, Gemma4Config
from .model import Gemma4Model
from .vision_config import VisionConfig, vision_config
from .vision_weights import ClippedLinear, VisionLayerWeights, VisionWeights
from .weights import (
    AttentionWeights,
    LayerWeights,
    MlpWeights,
    ModelWeights,
    MoeWeights,
    PleWeights,
)

# Gemma-4-26B-A4B's text model, as its config.json's text_config (a third-party loader's
# field-by-field listing): 30 layers, every sixth full (25 sliding + 5 full, the last full);
# H 2816, 16 heads; sliding layers 8 KV heads x 256, window 1024; full layers 2 KV heads x 512
# with k_eq_v; a dense GeGLU of 2112 beside a 128-expert top-8 MoE of width 704 in every layer;
# no per-layer embeddings, no KV sharing; softcap 30; 262144 positions; tied; 25.23B
# parameters (22.84B in routed experts, 3.82B active a token), 50.5 GB in bf16.
CONFIGS: dict[str, dict[str, Any]] = {
    "Gemma-4-26B-A4B": dict(
        model_type="gemma4_text",
        vocab_size=262_144,
        hidden_size=2816,
        intermediate_size=2112,
        num_hidden_layers=30,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        layer_types=[FULL if (i + 1) % 6 == 0 else SLIDING for i in range(30)],
        sliding_window=1024,
        rope_parameters=DEFAULT_ROPE,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        final_logit_softcapping=30.0,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=262_144,
        num_kv_shared_layers=0,
        use_double_wide_mlp=False,
        max_position_embeddings=262_144,
        use_bidirectional_attention="vision",
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    ),
}
SHAPES: dict[str, Gemma4Config] = {
    name: Gemma4Config.from_dict(raw, f"dummy.CONFIGS[{name!r}]") for name, raw in CONFIGS.items()
}


def dummy_weights(
    cfg: Gemma4Config,
    device: str,
    dtype: torch.dtype,
    seed: int = 0,
    std: float = 0.02,
    fp8: bool = False,
) -> ModelWeights:
    """fp8: each layer's linears quantized (`quantize_layer`) as soon as it is drawn, so the
    peak holds one layer in `dtype` beside the fp8 rest."""
    tp = parallel.current()
    world = tp.world
    if world > 1:
        shards.check(cfg, world)
    init, part = rank_draws(device, dtype, seed, std)  # replicated; this rank's slices
    h, heads = cfg.hidden_size, cfg.num_attention_heads // world
    embed = init.normal(cfg.vocab_size, h)
    layers = []
    for layer in cfg.layers:
        d, own = layer.head_dim, not layer.reuses_kv
        q, kv = heads * d, shards.kv_local(layer, world) * d
        attention = AttentionWeights(
            q=part.normal(q, h),
            k=part.normal(kv, h) if own else None,
            v=part.normal(kv, h) if own and not layer.k_eq_v else None,
            o=part.normal(h, q),
            q_norm=init.norm(d),
            k_norm=init.norm(d) if own else None,
        )
        n = layer.mlp_size // world
        mlp = MlpWeights(part.normal(n, h), part.normal(n, h), part.normal(h, n))
        moe = None
        if cfg.enable_moe_block:
            e, i = cfg.num_experts, cfg.moe_intermediate_size
            local = Shard(tp.rank, world).experts(e)
            moe = MoeWeights(
                router=init.normal(e, h, std=1.0),
                router_scale=init.ones(h),
                per_expert_scale=init.ones(e),
                gate_up=part.normal(len(local), 2 * i, h),
                down=part.normal(len(local), h, i),
                pre_norm=init.norm(h),
                post_norm_mlp=init.norm(h),
                post_norm_experts=init.norm(h),
                first_expert=local.start,
            )
        ple = None
        if cfg.has_ple:
            p = cfg.hidden_size_per_layer_input
            ple = PleWeights(init.normal(p, h), init.normal(h, p), init.norm(h))
        layer = LayerWeights(
            input_norm=init.norm(h),
            post_attention_norm=init.norm(h),
            pre_mlp_norm=init.norm(h),
            post_mlp_norm=init.norm(h),
            attention=attention,
            mlp=mlp,
            moe=moe,
            ple=ple,
            layer_scalar=init.ones(1),
        )
        layers.append(quantize_layer(layer) if fp8 else layer)
    ple_embed = ple_projection = ple_norm = None
    if cfg.has_ple:
        lp = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
        ple_embed = init.normal(cfg.vocab_size_per_layer_input, lp)
        ple_projection = init.normal(lp, h)
        ple_norm = init.norm(cfg.hidden_size_per_layer_input)
    vocab = block(cfg.vocab_size, tp.rank, world) if shards.vocab_parallel(cfg, world) else None
    lm_head = dummy_lm_head(init, part, embed, cfg.tie_word_embeddings, vocab)
    return ModelWeights(embed, init.norm(h), lm_head, layers, ple_embed, ple_projection, ple_norm)


def _fp8(t: torch.Tensor | None) -> Fp8Weight | None:
    return None if t is None else quantize_blocks(t)


def quantize_layer(layer: LayerWeights) -> LayerWeights:
    """--quantization fp8 on a dummy layer, in place: the linears weights.py reads with
    `read.linear` quantized to 128 x 128 blocks as the loader quantizes them (q, k and v apart,
    then joined; each expert stack a matrix at a time)."""
    a = layer.attention
    layer.attention = AttentionWeights(
        _fp8(a.q), _fp8(a.k), _fp8(a.v), _fp8(a.o), a.q_norm, a.k_norm
    )
    m = layer.mlp
    m.gate, m.up, m.down = (quantize_blocks(t) for t in (m.gate, m.up, m.down))
    if layer.moe is not None:
        layer.moe.gate_up = quantize_blocks(layer.moe.gate_up)
        layer.moe.down = quantize_blocks(layer.moe.down)
    return layer


def build_dummy(
    cfg: str | Gemma4Config,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    std: float = 0.02,
    quantization: str = "auto",
) -> Gemma4Model:
    """A model at `cfg` (a name in SHAPES, or a config) with dummy weights on `device`; its
    linears in fp8 with quantization="fp8" (`quantize_layer`)."""
    config = SHAPES[cfg] if isinstance(cfg, str) else cfg
    weights = dummy_weights(config, device, dtype, seed, std, fp8=quantization == "fp8")
    return Gemma4Model(config, weights, device, dtype)


def load_dummy(config: dict, device: str, dtype: str, quantization: str = "auto") -> Gemma4Model:
    """TF_LOAD_FORMAT=dummy: the checkpoint's config.json with random weights (fp8 linears under
    --quantization fp8)."""
    from tensorfold.family.checkpoint import torch_dtype

    cfg = Gemma4Config.from_dict(config, "config.json")
    model = build_dummy(cfg, device, torch_dtype(dtype), quantization=quantization)
    vision = vision_config(config) if cfg.has_vision else None
    if vision is not None:
        model.vision_cfg = vision
        model.vision_weights = dummy_vision_weights(vision, device, torch_dtype(dtype))
    audio = audio_config(config) if cfg.has_audio else None
    if audio is not None:
        model.audio_cfg = audio
        model.audio_weights = dummy_audio_weights(audio, device, torch_dtype(dtype))
    return model


def dummy_vision_weights(
    cfg: VisionConfig, device: str, dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> VisionWeights:
    """The vision tower and its embedder with random weights on `device` (the same on every
    rank: the tower is not cut), norms 1 + N(0, 0.1²) in fp32, no clipping bounds."""
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen, device=device)

    def linear(n: int, k: int) -> ClippedLinear:
        return ClippedLinear(normal(n, k), None)

    hv, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    layers = [
        VisionLayerWeights(
            q=linear(q, hv),
            k=linear(kv, hv),
            v=linear(kv, hv),
            o=linear(hv, q),
            q_norm=norm(d),
            k_norm=norm(d),
            gate=linear(i, hv),
            up=linear(i, hv),
            down=linear(hv, i),
            input_norm=norm(hv),
            post_attention_norm=norm(hv),
            pre_mlp_norm=norm(hv),
            post_mlp_norm=norm(hv),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return VisionWeights(
        input_proj=normal(hv, cfg.patch_width),
        positions=normal(2, cfg.position_embedding_size, hv),
        layers=layers,
        std_bias=normal(hv).float() if cfg.standardize else None,
        std_scale=norm(hv) if cfg.standardize else None,
        projection=normal(cfg.text_hidden_size, hv),
    )


def dummy_audio_weights(
    cfg: AudioConfig, device: str, dtype: torch.dtype, seed: int = 0, std: float = 0.02
) -> AudioWeights:
    """The audio tower and its embedder with random weights on `device` (the same on every
    rank), norms 1 + N(0, 0.1²) in fp32, no clipping bounds."""
    gen = torch.Generator(device=device).manual_seed(seed + 2)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen, device=device)

    def linear(n: int, k: int) -> ClippedLinear:
        return ClippedLinear(normal(n, k), None)

    def ffn() -> FeedForwardWeights:
        return FeedForwardWeights(linear(4 * ha, ha), linear(ha, 4 * ha), norm(ha), norm(ha))

    ha, (c0, c1) = cfg.hidden_size, cfg.subsampling_conv_channels
    layers = [
        AudioLayerWeights(
            ffn1=ffn(),
            ffn2=ffn(),
            q=linear(ha, ha),
            k=linear(ha, ha),
            v=linear(ha, ha),
            post=linear(ha, ha),
            relative_k=normal(ha, ha),
            per_dim_scale=norm(cfg.head_dim) - 1,
            conv_start=linear(2 * ha, ha),
            conv_end=linear(ha, ha),
            depthwise=normal(ha, 1, cfg.conv_kernel_size),
            conv_pre_norm=norm(ha),
            conv_norm=norm(ha),
            norm_pre_attn=norm(ha),
            norm_post_attn=norm(ha),
            norm_out=norm(ha),
        )
        for _ in range(cfg.num_hidden_layers)
    ]
    return AudioWeights(
        conv0=normal(c0, 1, 3, 3),
        conv0_norm=norm(c0),
        conv1=normal(c1, c0, 3, 3),
        conv1_norm=norm(c1),
        input_proj=normal(ha, cfg.subsampled_width),
        layers=layers,
        output_proj=normal(cfg.output_proj_dims, ha),
        output_bias=normal(cfg.output_proj_dims),
        projection=normal(cfg.text_hidden_size, cfg.output_proj_dims),
    )
