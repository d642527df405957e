"""config.json's `audio_config` of a Gemma 4 E-checkpoint (Gemma4AudioConfig, transformers 5.23.0).

Defaults are the class defaults (configuration_gemma4.py): a Conformer of 12 layers x 1024 with
chunked local attention (chunks of 12, 13 frames of left context, none to the right), its logits
capped at 50, a causal depthwise conv of kernel 5, and an output projection to 1536 that
`embed_audio` maps to the text width. No torch import: read before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .config import ConfigError, Fields

AUDIO_ACTIVATIONS = ("silu", "swish")  # the same function under its two names in ACT2FN
# the most soft tokens Gemma 4's processor gives a clip (audio_seq_length), and the log-mel
# frames and bins behind them; the memory plan counts the tower at this size
LONGEST_CLIP_TOKENS = 750
LONGEST_CLIP_FRAMES = 4 * LONGEST_CLIP_TOKENS
MEL_BINS = 128


@dataclass(frozen=True)
class AudioConfig:
    """The audio tower's shape, and the text width its embedder projects to."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    subsampling_conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_proj_dims: int
    text_hidden_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def context_size(self) -> int:
        """The keys one chunk of queries sees: the chunk, its past horizon and its future."""
        return (
            self.attention_chunk_size
            + self.attention_context_left
            - 1
            + self.attention_context_right
        )

    @property
    def subsampled_width(self) -> int:
        """The input projection's width, as the reference computes it: first conv's channels // 4
        times the second's. It is the mel bins after two stride-2 convs times the second's
        channels only where the mel bins equal the first conv's channels (128 in Gemma 4)."""
        return (self.subsampling_conv_channels[0] // 4) * self.subsampling_conv_channels[1]

    def activation_bytes(self, frames: int, mel: int, itemsize: int) -> int:
        """A bound on the device bytes the tower holds at once on one clip of `frames` log-mel
        frames of `mel` bins, in weights of `itemsize` bytes (each counted at fp32 or wider):
        each subsampling conv's output, its norm and ReLU; a layer's rows (the residual, the
        feed-forward's 4x-wide hidden and its activation, q, k, v, their chunk windows, the
        light conv's 2x-wide input and output, norms); the chunked scores, their softmax and
        mask; the output and the text-width embeddings; and the features."""
        wide = max(itemsize, 4)
        c0, c1 = self.subsampling_conv_channels
        t1, m1 = -(-frames // 2), -(-mel // 2)
        t2, m2 = -(-t1 // 2), -(-m1 // 2)
        convs = 3 * wide * (c0 * t1 * m1 + c1 * t2 * m2)
        ha, ctx = self.hidden_size, self.context_size
        blocks = -(-t2 // self.attention_chunk_size)
        windows = blocks * ctx  # each of k and v per chunk window
        rows = wide * (
            t2 * (20 * ha + self.output_proj_dims + self.text_hidden_size) + 2 * windows * ha
        )
        scores = 4 * self.num_attention_heads * blocks * self.attention_chunk_size * ctx * 4
        return convs + rows + scores + 4 * frames * mel


def audio_config(raw: Mapping[str, Any], source: str = "config.json") -> AudioConfig | None:
    """The tower's config from the whole config.json `raw`; None when it has no audio_config."""
    a = raw.get("audio_config")
    if a is None:
        return None
    text = raw.get("text_config")
    if not isinstance(a, dict) or not isinstance(text, dict):
        raise ConfigError(f"{source}: 'audio_config' needs a nested 'text_config' beside it")
    where = f"{source} audio_config"

    get = Fields(a, where)

    if get("hidden_act", "silu", str) not in AUDIO_ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_act must be one of {', '.join(AUDIO_ACTIVATIONS)}")
    channels = a.get("subsampling_conv_channels") or [128, 32]
    if (
        not isinstance(channels, (list, tuple))
        or len(channels) != 2
        or not all(isinstance(c, int) and c > 0 for c in channels)
    ):
        raise ConfigError(f"{where}: 'subsampling_conv_channels' must be two positive ints")
    cfg = AudioConfig(
        hidden_size=get("hidden_size", 1024, int),
        num_hidden_layers=get("num_hidden_layers", 12, int),
        num_attention_heads=get("num_attention_heads", 8, int),
        subsampling_conv_channels=(channels[0], channels[1]),
        conv_kernel_size=get("conv_kernel_size", 5, int),
        residual_weight=get("residual_weight", 0.5, float),
        attention_chunk_size=get("attention_chunk_size", 12, int),
        attention_context_left=get("attention_context_left", 13, int),
        attention_context_right=get("attention_context_right", 0, int),
        attention_logit_cap=get("attention_logit_cap", 50.0, float),
        attention_invalid_logits_value=get("attention_invalid_logits_value", -1.0e9, float),
        use_clipped_linears=get("use_clipped_linears", True, bool),
        rms_norm_eps=get("rms_norm_eps", 1e-6, float),
        gradient_clipping=get("gradient_clipping", 1e10, float),
        output_proj_dims=get("output_proj_dims", 1536, int),
        text_hidden_size=int(text.get("hidden_size", 2304)),
    )
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(f"{where}: hidden_size must be a multiple of num_attention_heads")
    if cfg.attention_chunk_size < 1 or cfg.attention_context_left < 1:
        raise ConfigError(
            f"{where}: attention_chunk_size and attention_context_left must be at least 1"
        )
    if cfg.attention_context_right < 0 or cfg.conv_kernel_size < 1:
        raise ConfigError(
            f"{where}: attention_context_right must be >= 0 and conv_kernel_size >= 1"
        )
    return cfg
