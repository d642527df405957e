"""Gemma 4's image preprocessing, as transformers 5.23.0's Gemma4ImageProcessorPil does it: RGB
(transparency composited onto white), an aspect-preserving resize to the largest size whose sides
are multiples of pooling_kernel_size·patch_size within max_soft_tokens·k² patches (PIL, bicubic by
default), rescale by 1/255 (in float64, then float32), optional normalise, patches row-major, and
zero padding to max_patches with (-1, -1) positions. An image's soft tokens (its placeholder
count) are its patches / k².

Settings come from the checkpoint folder's preprocessor_config.json, or the `image_processor`
object of its processor_config.json. Pillow is imported only when images are processed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .config import ConfigError

if TYPE_CHECKING:
    from PIL.Image import Image

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True)
class ImageSettings:
    """The image processor's settings (Gemma4ImageProcessorPil's class defaults unless given)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    do_resize: bool = True
    resample: int = BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    image_std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    do_convert_rgb: bool = True

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size**2

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> "ImageSettings":
        known = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        for key in ("image_mean", "image_std"):
            if key in known:
                value = known[key]
                known[key] = tuple(
                    float(v) for v in (value if isinstance(value, list) else [value] * 3)
                )
        settings = cls(**known)
        if settings.max_soft_tokens not in SUPPORTED_SOFT_TOKENS:
            raise ConfigError(
                f"{source}: max_soft_tokens must be one of {SUPPORTED_SOFT_TOKENS}, "
                f"got {settings.max_soft_tokens}"
            )
        return settings

    @classmethod
    def from_folder(cls, folder: Path) -> "ImageSettings":
        """From preprocessor_config.json, else processor_config.json's `image_processor`."""
        pre, proc = folder / "preprocessor_config.json", folder / "processor_config.json"
        if pre.is_file():
            return cls.from_dict(json.loads(pre.read_text()), str(pre))
        if proc.is_file():
            raw = json.loads(proc.read_text()).get("image_processor")
            if isinstance(raw, dict):
                return cls.from_dict(raw, f"{proc} image_processor")
        raise ConfigError(f"{folder}: no image processor settings (preprocessor_config.json)")


@dataclass
class ImageBatch:
    """What the vision tower takes (vision.image_soft_tokens), and each image's placeholder count."""

    pixel_values: torch.Tensor  # [B, max_patches, 3·patch²] fp32
    image_position_ids: torch.Tensor  # [B, max_patches, 2] int64, (x, y); (-1, -1) on padding
    soft_tokens: list[int]  # per image: patches / pooling_kernel_size²


def resized_size(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """The (height, width) an image is resized to (get_aspect_ratio_preserving_size)."""
    target_px = s.max_patches * s.patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side = s.pooling_kernel_size * s.patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError(f"a {height}x{width} image resizes to 0 x 0")
    longest = (s.max_patches // s.pooling_kernel_size**2) * side
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    if th * tw > target_px:
        raise ValueError(f"a {height}x{width} image resizes past {s.max_patches} patches")
    return th, tw


def preprocess(images: Sequence["Image"], s: ImageSettings) -> ImageBatch:
    """Images (PIL) -> the tower's inputs, as the processor lays them out."""
    p, width = s.patch_size, 3 * s.patch_size**2
    pixels = torch.zeros(len(images), s.max_patches, width)
    positions = torch.full((len(images), s.max_patches, 2), -1, dtype=torch.long)
    soft_tokens = []
    for i, image in enumerate(images):
        chw = _pixels(image, s)
        c, h, w = chw.shape
        ph, pw = h // p, w // p
        patches = chw.reshape(c, ph, p, pw, p).permute(1, 3, 2, 4, 0).reshape(ph * pw, -1)
        if len(patches) > s.max_patches:
            raise ValueError(f"an image of {len(patches)} patches exceeds {s.max_patches}")
        ys, xs = torch.meshgrid(torch.arange(ph), torch.arange(pw), indexing="ij")
        pixels[i, : len(patches)] = patches
        positions[i, : len(patches)] = torch.stack((xs.reshape(-1), ys.reshape(-1)), dim=-1)
        soft_tokens.append(len(patches) // s.pooling_kernel_size**2)
    return ImageBatch(pixels, positions, soft_tokens)


def _pixels(image: "Image", s: ImageSettings) -> torch.Tensor:
    """One image resized, rescaled and normalised: [3, H, W] fp32."""
    from PIL import Image as PILImage

    if s.do_convert_rgb:
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = PILImage.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = PILImage.alpha_composite(white, rgba).convert("RGB")
        else:
            image = image.convert("RGB")
    if s.do_resize:
        th, tw = resized_size(image.height, image.width, s)
        if (th, tw) != (image.height, image.width):
            image = image.resize((tw, th), resample=s.resample)
    raw = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    x = raw.view(image.height, image.width, 3).permute(2, 0, 1)
    out = (x.double() * s.rescale_factor).float() if s.do_rescale else x.float()
    if s.do_normalize:
        mean = torch.tensor(s.image_mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(s.image_std, dtype=torch.float32)[:, None, None]
        out = (out - mean) / std
    return out
