"""config.json's `vision_config` of a Gemma 4 checkpoint (Gemma4VisionConfig, transformers 5.23.0).

Defaults are the class defaults (configuration_gemma4.py); RoPE is the "axial" kind only, its
theta from `rope_parameters` (100 by default). No torch import: read before the weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .config import ACTIVATIONS, ConfigError, Fields

QUERY_CHUNK = 512  # the tower's attention takes its queries in chunks of this many patches
# the most soft tokens Gemma 4's image processor gives an image (its largest max_soft_tokens);
# the memory plan counts the tower at this size, whatever a checkpoint's processor says
LARGEST_SOFT_TOKENS = 1120


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape, and the text width its embedder projects to."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    pooling_kernel_size: int
    patch_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    text_hidden_size: int

    @property
    def patch_width(self) -> int:
        """One patch's pixel values: 3 channels of patch_size² pixels."""
        return 3 * self.patch_size**2

    @property
    def largest_image_patches(self) -> int:
        """The patches of the largest image the processor may give (LARGEST_SOFT_TOKENS)."""
        return LARGEST_SOFT_TOKENS * self.pooling_kernel_size**2

    def activation_bytes(self, patches: int, itemsize: int) -> int:
        """A bound on the device bytes the tower holds at once on images of `patches`
        patches together in weights of `itemsize` bytes: a layer's rows (the residual, its
        norms, q, k, v, their GQA copies and attention's head-major copies, the attention
        output, the MLP's gate, up and product, each counted at fp32 or wider), one query
        chunk's scores (in the weights' dtype, their softmax in fp32 and its cast back), and
        the pixel values."""
        wide = max(itemsize, 4)
        heads, d = self.num_attention_heads, self.head_dim
        rows = (
            patches
            * wide
            * (
                8 * self.hidden_size
                + 9 * heads * d
                + 3 * self.intermediate_size
                + 2 * self.patch_width
            )
        )
        scores = heads * min(QUERY_CHUNK, patches) * patches * (2 * itemsize + 4)
        return rows + scores


def vision_config(raw: Mapping[str, Any], source: str = "config.json") -> VisionConfig | None:
    """The tower's config from the whole config.json `raw`; None when it has no vision_config."""
    v = raw.get("vision_config")
    if v is None:
        return None
    text = raw.get("text_config")
    if not isinstance(v, dict) or not isinstance(text, dict):
        raise ConfigError(f"{source}: 'vision_config' needs a nested 'text_config' beside it")
    where = f"{source} vision_config"

    get = Fields(v, where)

    rope = v.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ConfigError(f"{where}: rope_type {rope.get('rope_type')!r}; only 'axial' is known")
    if get("hidden_activation", ACTIVATIONS[0], str) not in ACTIVATIONS:
        raise ConfigError(f"{where}: hidden_activation must be one of {', '.join(ACTIVATIONS)}")
    heads = get("num_attention_heads", 12, int)
    cfg = VisionConfig(
        hidden_size=get("hidden_size", 768, int),
        intermediate_size=get("intermediate_size", 3072, int),
        num_hidden_layers=get("num_hidden_layers", 16, int),
        num_attention_heads=heads,
        num_key_value_heads=get("num_key_value_heads", heads, int),
        head_dim=get("head_dim", 64, int),
        rms_norm_eps=get("rms_norm_eps", 1e-6, float),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        pooling_kernel_size=get("pooling_kernel_size", 3, int),
        patch_size=get("patch_size", 16, int),
        position_embedding_size=get("position_embedding_size", 10 * 1024, int),
        use_clipped_linears=get("use_clipped_linears", False, bool),
        standardize=get("standardize", False, bool),
        text_hidden_size=int(text.get("hidden_size", 2304)),
    )
    if cfg.head_dim % 4 or cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: head_dim must be a multiple of 4 (two axes of rotated pairs) and "
            "num_attention_heads a multiple of num_key_value_heads"
        )
    return cfg
