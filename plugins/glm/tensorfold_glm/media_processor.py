"""glm5_next's answer to the `media_processor` hook: how an image becomes a prompt's rows.

The chat template writes `<|begin_of_image|><|image|><|end_of_image|>` where an image goes;
the one `<|image|>` (config.json's `image_token_id`) becomes one `<|image|>` per row the tower
gives, t·h·w / merge² of the image's grid (transformers 5.23.0's `Glm5NextProcessor.
replace_image_token`), and the tower's rows replace those tokens' embeddings in order (its
`masked_scatter`). Rows are causal as any text row (no block): glm5_next's text layers are NoPE
and see an image's rows as a run of tokens.

The preprocessing settings come from the checkpoint's `preprocessor_config.json` (or the
`image_processor` part of `processor_config.json`), the processor's defaults where neither
is there; patch, temporal patch and merge sizes must agree with config.json's `vision_config`.
Cheap to build (json, no torch); `prepare_image` imports torch and Pillow when first asked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from tensorfold.family.media import MediaRefused

from .vision_memory import DEFAULT_MAX_ROWS

if TYPE_CHECKING:
    import torch
    from PIL import Image

    from .image_processing import ImageProcessor

__all__ = ["GlmImage", "GlmMediaProcessor", "media_processor", "processor_settings"]

PLACEHOLDER = "<|image|>"
# the processor's fields that must match the tower's (processor name -> vision_config name)
TOWER_FIELDS = {
    "patch_size": "patch_size",
    "temporal_patch_size": "temporal_patch_size",
    "merge_size": "spatial_merge_size",
}


@dataclass(frozen=True, eq=False)
class GlmImage:
    """One prepared image, a MediaPiece's `inputs`: pixel_values [h·w, C·T·P·P] float32 in the
    tower's block-major order, and its grid (t, h, w) in patches."""

    pixel_values: "torch.Tensor"
    grid_thw: tuple[int, int, int]


@dataclass
class GlmMediaProcessor:
    """A `tensorfold.family.media.MediaProcessor` for glm5_next images."""

    placeholder_id: int
    settings: dict[str, Any]  # preprocessor_config.json's fields (ImageProcessor.from_dict)
    placeholder: str = PLACEHOLDER
    kinds: frozenset[str] = frozenset({"image"})
    block: bool = False
    _processor: "ImageProcessor | None" = field(default=None, repr=False)

    @property
    def processor(self) -> "ImageProcessor":
        if self._processor is None:
            from .image_processing import ImageProcessor

            self._processor = ImageProcessor.from_dict(self.settings)
        return self._processor

    @property
    def max_rows(self) -> int:
        """The most rows an image fills: max_image_tokens merge blocks."""
        return int(self.settings.get("max_image_tokens") or DEFAULT_MAX_ROWS)

    def prepare_image(self, image: "Image.Image") -> tuple[GlmImage, int]:
        """MediaRefused for an image past the rows the memory plan counted the tower at
        (layout.shape reads config.json alone: the processor's default max_image_tokens,
        which a checkpoint's preprocessor_config.json may raise)."""
        done = self.processor([image])
        t, h, w = (int(v) for v in done.grid_thw[0].tolist())
        rows = done.token_counts[0]
        if rows > DEFAULT_MAX_ROWS:
            raise MediaRefused(
                f"the image fills {rows} rows (max_image_tokens {self.max_rows} in the "
                f"checkpoint's image processor settings), past the {DEFAULT_MAX_ROWS} rows the "
                "memory plan counts the vision tower at; send a smaller image"
            )
        return GlmImage(done.pixel_values, (t, h, w)), rows

    def image_ids(self, rows: int) -> tuple[list[int], int]:
        # begin- and end-of-image stay the template's own tokens around the placeholder
        return [self.placeholder_id] * rows, 0


def processor_settings(folder: Path | None) -> dict[str, Any]:
    """The image processor's settings in the checkpoint: preprocessor_config.json, else the
    `image_processor` object of processor_config.json, else none (the defaults)."""
    if folder is None:
        return {}
    pre = Path(folder) / "preprocessor_config.json"
    if pre.is_file():
        return dict(json.loads(pre.read_text(encoding="utf-8")))
    joint = Path(folder) / "processor_config.json"
    if joint.is_file():
        part = json.loads(joint.read_text(encoding="utf-8")).get("image_processor")
        return dict(part) if isinstance(part, dict) else {}
    return {}


def media_processor(folder: Path | None, config: Mapping[str, Any]) -> GlmMediaProcessor | None:
    """The hook's answer: None when config.json has no vision_config (a text-only checkpoint).
    Without a folder (a dummy model) the processor's defaults, sized by the vision_config."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    token = config.get("image_token_id")
    if not isinstance(token, int):
        raise ValueError("config.json has a vision_config but no image_token_id")
    settings = processor_settings(folder)
    for ours, theirs in TOWER_FIELDS.items():
        if theirs not in vision:
            continue
        if ours not in settings:
            settings[ours] = vision[theirs]
        elif settings[ours] != vision[theirs]:
            raise ValueError(
                f"the image processor's {ours} {settings[ours]} is not the vision tower's "
                f"{theirs} {vision[theirs]} (config.json)"
            )
    return GlmMediaProcessor(token, settings)
