"""What the vision tower holds on the device, from config.json alone (no torch): its weights and
its activations at the largest image the image processor makes, for the memory plan.

Weights: the checkpoint's `model.visual.*` tensors are already in the plan's weight bytes (the
start counts every tensor of the checkpoint, `Checkpoint.local_bytes`, the tower's too, whole
on every tensor-parallel rank); `tower_weight_bytes` gives the same number from the config.

Activations: the tower runs before the prompt pass that reads its rows, on images whose rows
together stay within DEFAULT_MAX_ROWS (the model's encode_media, `tower_batches`), so its peak is
that of one image at DEFAULT_MAX_ROWS merge blocks (4 x that many patches at merge 2): attention
runs within each image, and everything else grows with the rows.
`tower_activation_bytes` bounds what vision.py holds at once in each of its three phases (a
block's attention, a block's MLP, the merger), the largest of them plus the pixel rows in and
the rows out. The bound counts every intermediate tensor of a phase as live at once, torch's
fp32 temporaries included (rotary, SwiGLU, the CPU attention's score blocks); the GPU test
(tests/test_glm_media_gpu.py) checks it against torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

from typing import Any, Mapping

from .vision_config import VisionConfig

__all__ = ["tower_weight_bytes", "tower_activation_bytes", "tower_bytes_for_config"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
F32 = 4
# Glm5NextImageProcessorPil's max_image_tokens (image_processing.ImageProcessor's default)
DEFAULT_MAX_ROWS = 8000
SCORE_BYTES = 256 << 20  # the CPU attention's fp32 scores a block of queries holds at most


def tower_weight_bytes(cfg: VisionConfig, dtype_bytes: int) -> int:
    """The tower's parameters x dtype_bytes (what vision_weights.load_vision_weights loads)."""
    d, i, o, p = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size, cfg.patch_dim
    m2, proj = cfg.spatial_merge_size**2, cfg.projection_intermediate_size
    block = 2 * d + 3 * d * d + d * d + 2 * cfg.head_dim + 3 * i * d
    if cfg.attention_bias:
        block += 3 * d + d + 2 * i + d
    count = d * p + d + cfg.depth * block + d  # patch embedding, blocks, post norm
    count += o * m2 * d + o  # downsample
    count += o * o + 2 * o + 3 * proj * o  # merger
    return count * dtype_bytes


def tower_activation_bytes(
    cfg: VisionConfig,
    max_rows: int,
    dtype_bytes: int,
    cuda: bool = True,
    score_bytes: int = SCORE_BYTES,
) -> int:
    """A bound on the bytes one tower pass holds at an image of max_rows rows (merge blocks).
    cuda: torch's fused attention (no score matrix); else the CPU's query blocks of at most
    score_bytes fp32 scores (SCORE_BYTES)."""
    e = dtype_bytes
    n = max_rows * cfg.spatial_merge_size**2  # patches
    d, i, o = cfg.hidden_size, cfg.intermediate_size, cfg.out_hidden_size
    proj = cfg.projection_intermediate_size
    residual = 2 * d * e  # x and its normed copy
    # qkv; q, k normed; the rotary's fp32 input, rotated half and products; each image's q, k,
    # v copied for attention; fp32 q, k, v; the output's blocks and their concatenation
    attention = n * (
        residual + 3 * d * e + 2 * d * e + 4 * d * F32 + 3 * d * e + 3 * d * F32 + 2 * d * e
    )
    if not cuda:
        attention += 4 * score_bytes  # scores, scaled, exp, probabilities of one query block
    # gate, up, their clamps, silu's output and the product; silu's fp32 input, exp and sum
    mlp = n * (residual + 6 * i * e + 3 * i * F32)
    merger = n * residual + max_rows * (3 * o * e + 6 * proj * e + 3 * proj * F32)
    pixels = n * cfg.patch_dim * F32 + n * cfg.patch_dim * e  # fp32 rows and their cast
    return pixels + max(attention, mlp, merger) + max_rows * o * e


def tower_bytes_for_config(config: Mapping[str, Any], dtype: str) -> int:
    """tower_activation_bytes on CUDA for config.json at the image processor's default largest
    image (shape() reads config.json alone, not the checkpoint's preprocessor_config.json); 0
    without a vision_config."""
    raw = config.get("vision_config")
    if not isinstance(raw, dict):
        return 0
    cfg = VisionConfig.from_dict(raw)
    e = DTYPE_BYTES[str(dtype).removeprefix("torch.")]
    return tower_activation_bytes(cfg, DEFAULT_MAX_ROWS, e)
