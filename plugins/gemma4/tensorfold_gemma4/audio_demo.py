"""The random audio tower of the tiny image-and-audio demo checkpoint (vision_demo.py with
`audio=True`): config.json's `audio_config` and the tensors of `model.audio_tower.*` and
`model.embed_audio.*` under their on-disk names, drawn from a fixed seed, as transformers 5.23.0
saves a Gemma4ForConditionalGeneration with an audio_config. The tower is untrained: its clips
mean nothing to the text model. Same bytes on every build.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SEED = 20261207
# the demo tokenizer's names -> Gemma 4's (boa, the audio token, eoa)
AUDIO_TOKENS = {
    "<start_of_audio>": "<|audio>",
    "<audio_soft_token>": "<|audio|>",
    "<end_of_audio>": "<audio|>",
}
AUDIO: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    subsampling_conv_channels=[128, 2],  # 128: the feature extractor's default mel bins
    output_proj_dims=24,
    use_clipped_linears=False,
)
KERNEL = 5  # the light conv's kernel (conv_kernel_size)


def audio_config() -> dict[str, Any]:
    """config.json's audio_config, as Gemma4AudioConfig writes it (its other defaults)."""
    return {
        **AUDIO,
        "model_type": "gemma4_audio",
        "hidden_act": "silu",
        "conv_kernel_size": KERNEL,
        "residual_weight": 0.5,
        "attention_chunk_size": 12,
        "attention_context_left": 13,
        "attention_context_right": 0,
        "attention_logit_cap": 50.0,
        "attention_invalid_logits_value": -1.0e9,
        "rms_norm_eps": 1e-06,
        "gradient_clipping": 1e10,
        "initializer_range": 0.02,
    }


def audio_weights(text_hidden: int) -> dict[str, "torch.Tensor"]:
    """The tower's and its embedder's tensors under their on-disk names, from a fixed seed."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    ha, out = AUDIO["hidden_size"], AUDIO["output_proj_dims"]
    c0, c1 = AUDIO["subsampling_conv_channels"]
    d = ha // AUDIO["num_attention_heads"]

    def normal(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def near_one(*shape: int) -> torch.Tensor:
        return 1.0 + normal(*shape, std=0.1)

    t, sub = "model.audio_tower", "model.audio_tower.subsample_conv_projection"
    w = {
        f"{sub}.layer0.conv.weight": normal(c0, 1, 3, 3, std=0.3),
        f"{sub}.layer0.norm.weight": near_one(c0),
        f"{sub}.layer1.conv.weight": normal(c1, c0, 3, 3, std=0.05),
        f"{sub}.layer1.norm.weight": near_one(c1),
        f"{sub}.input_proj_linear.weight": normal(ha, (c0 // 4) * c1),
        f"{t}.output_proj.weight": normal(out, ha),
        f"{t}.output_proj.bias": normal(out),
        "model.embed_audio.embedding_projection.weight": normal(text_hidden, out),
    }
    for i in range(AUDIO["num_hidden_layers"]):
        p = f"{t}.layers.{i}"
        linears = {
            "self_attn.q_proj": (ha, ha),
            "self_attn.k_proj": (ha, ha),
            "self_attn.v_proj": (ha, ha),
            "self_attn.post": (ha, ha),
            "lconv1d.linear_start": (2 * ha, ha),
            "lconv1d.linear_end": (ha, ha),
        }
        for f in ("feed_forward1", "feed_forward2"):
            linears[f"{f}.ffw_layer_1"] = (4 * ha, ha)
            linears[f"{f}.ffw_layer_2"] = (ha, 4 * ha)
            w[f"{p}.{f}.pre_layer_norm.weight"] = near_one(ha)
            w[f"{p}.{f}.post_layer_norm.weight"] = near_one(ha)
        for name, shape in linears.items():
            w[f"{p}.{name}.linear.weight"] = normal(*shape)
        w[f"{p}.self_attn.relative_k_proj.weight"] = normal(ha, ha)
        w[f"{p}.self_attn.per_dim_scale"] = normal(d)
        w[f"{p}.lconv1d.depthwise_conv1d.weight"] = normal(ha, 1, KERNEL)
        for norm in ("lconv1d.pre_layer_norm", "lconv1d.conv_norm", "norm_pre_attn"):
            w[f"{p}.{norm}.weight"] = near_one(ha)
        for norm in ("norm_post_attn", "norm_out"):
            w[f"{p}.{norm}.weight"] = near_one(ha)
    return w
