"""GLM-5.3-Flash's image preprocessing, as transformers 5.23.0's `Glm5NextImageProcessorPil` does
it: an image (Pillow) to the tower's pixel rows, its grid_thw and its number of image tokens.

Steps: RGB (transparency composited onto white); a size in whole merge blocks (factor =
patch_size · merge_size) within [min_image_tokens, max_image_tokens] blocks (`aligned_size`);
the content resized with Pillow (bicubic by default) only when it must shrink or grow, and
zero-padded at the bottom and right to that size; rescaled (in float64, rounded to float32),
normalised per channel (float32); cut into block-major patches, each repeated over
temporal_patch_size frames, one row of C·T·P·P values each. Settings from the checkpoint's
preprocessor_config.json, the processor's defaults where it leaves them out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["ImageProcessor", "ProcessedImages", "aligned_size"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


def aligned_size(
    height: int, width: int, frames: int, factor: int, min_tokens: int, max_tokens: int
) -> tuple[int, int]:
    """The (height, width) in whole multiples of `factor` the processor resizes and pads an
    image to: its own size rounded up, grown to min_tokens blocks where smaller, and where over
    max_tokens blocks the largest content height (binary search) whose rounded-up size fits."""
    per_token = frames * factor**2
    low_budget, high_budget = min_tokens * per_token, max_tokens * per_token

    def up(v: float) -> int:
        return math.ceil(v / factor) * factor

    t = frames  # an image is one group of temporal_patch_size frames
    h, w = up(height), up(width)
    if t * h * w < low_budget:
        scale = math.sqrt(low_budget / (frames * height * width))
        h, w = up(max(1, math.ceil(height * scale))), up(max(1, math.ceil(width * scale)))
    if t * h * w > high_budget:
        if high_budget < t * factor**2:
            raise ValueError(f"max_image_tokens={max_tokens} is below one merge block")
        lo, hi, best = 1, height, (factor, factor)
        while lo <= hi:
            mid = (lo + hi) // 2
            cand = (up(mid), up(max(1, math.floor(width * mid / height))))
            if t * cand[0] * cand[1] <= high_budget:
                best, lo = cand, mid + 1
            else:
                hi = mid - 1
        h, w = best
    return h, w


@dataclass
class ProcessedImages:
    pixel_values: torch.Tensor  # [patches, C·T·P·P] float32, the images' rows one after another
    grid_thw: torch.Tensor  # [images, 3] int64: (1, h, w) in patches
    token_counts: list[int]  # image placeholder tokens per image: h·w / merge²


@dataclass(frozen=True)
class ImageProcessor:
    """preprocessor_config.json's fields the preprocessing reads."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_image_tokens: int = 16
    max_image_tokens: int = 8000
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "ImageProcessor":
        fields = {f: raw[f] for f in cls.__dataclass_fields__ if raw.get(f) is not None}
        for f in ("image_mean", "image_std"):
            if f in fields:
                fields[f] = tuple(float(v) for v in fields[f])
        return cls(**fields)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ImageProcessor":
        """From the checkpoint's preprocessor_config.json (the defaults where it has none)."""
        path = Path(folder) / "preprocessor_config.json"
        return cls.from_dict(json.loads(path.read_text()) if path.exists() else {})

    def token_count(self, height: int, width: int) -> int:
        """Image tokens for an image of height x width pixels."""
        factor = self.patch_size * self.merge_size
        h, w = aligned_size(
            height,
            width,
            self.temporal_patch_size,
            factor,
            self.min_image_tokens,
            self.max_image_tokens,
        )
        return (h // factor) * (w // factor)

    def __call__(self, images: Sequence["Image.Image"]) -> ProcessedImages:
        rows, grids = [], []
        for image in images:
            pixels = self._pixels(image)
            rows.append(self._patches(pixels))
            grids.append(
                [1, pixels.shape[1] // self.patch_size, pixels.shape[2] // self.patch_size]
            )
        grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
        merge2 = self.merge_size**2
        return ProcessedImages(
            pixel_values=torch.cat(rows) if rows else torch.empty(0, self._row_size()),
            grid_thw=grid,
            token_counts=[int(h * w) // merge2 for _, h, w in grid.tolist()],
        )

    def _row_size(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def _pixels(self, image: "Image.Image") -> torch.Tensor:
        """[3, H', W'] float32: RGB, resized and padded, rescaled and normalised."""
        rgb = _rgb(image)
        width, height = rgb.size
        if self.do_resize:
            factor, frames = self.patch_size * self.merge_size, self.temporal_patch_size
            th, tw = aligned_size(
                height, width, frames, factor, self.min_image_tokens, self.max_image_tokens
            )
            scale = min(th / height, tw / width)
            if frames * height * width >= frames * factor**2 * self.min_image_tokens:
                scale = min(1.0, scale)  # a large enough image is never enlarged, only padded
            ch = max(1, min(th, math.floor(height * scale)))
            cw = max(1, min(tw, math.floor(width * scale)))
            if (ch, cw) != (height, width):
                rgb = rgb.resize((cw, ch), resample=self.resample)
        values = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
        x = values.reshape(rgb.size[1], rgb.size[0], 3).permute(2, 0, 1)  # [3, h, w] uint8
        if self.do_resize:
            x = torch.nn.functional.pad(x, (0, tw - x.shape[2], 0, th - x.shape[1]))
        out = x.float()
        if self.do_rescale:
            out = (x.double() * self.rescale_factor).float()
        if self.do_normalize:
            mean = torch.tensor(self.image_mean, dtype=torch.float32)[:, None, None]
            std = torch.tensor(self.image_std, dtype=torch.float32)[:, None, None]
            out = (out - mean) / std
        return out

    def _patches(self, x: torch.Tensor) -> torch.Tensor:
        """[3, H, W] -> [H·W/P², 3·T·P·P]: merge blocks row by row, each block's patches row by
        row, a patch's values (channel, frame, y, x), the frame a copy."""
        c, height, width = x.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        frames = blocks.unsqueeze(5).expand(*blocks.shape[:5], t, p, p)
        return frames.reshape(gh * gw, c * t * p * p)


def _rgb(image: "Image.Image") -> "Image.Image":
    """As transformers converts: transparency composited onto white, anything else to RGB."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
