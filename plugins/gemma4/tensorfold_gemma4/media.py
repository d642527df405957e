"""Gemma 4's images in a prompt: the `media_processor` hook's answer (tensorfold.family.media).

The chat template writes the image token (`<|image|>` in Gemma 4's tokenizer) once where each
image goes; the core replaces it, as Gemma4Processor does, by begin-of-image, one image token
for each soft token, end-of-image. The image tokens' rows are a block (MediaPiece.block) when
the text config has `use_bidirectional_attention: "vision"`: they attend to each other both ways
in the sliding layers, as modeling_gemma4.py's `create_masks_for_vision_model` lets them (its
`mm_token_type_ids` mark the image tokens alone, not begin- and end-of-image).

An image is prepared as Gemma4ImageProcessorPil does it (image_processing.py), with the
settings of the checkpoint's preprocessor_config.json (or processor_config.json), and kept as
its valid patches only (`GemmaImage`), which `Gemma4Model.encode_media` runs through the tower.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from tensorfold.family.media import MediaRefused

from .config import ConfigError
from .image_processing import ImageSettings, preprocess
from .vision_config import vision_config

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_TOKEN = "<|image|>"  # Gemma 4's image token, where a folder has no tokenizer to ask
DEFAULT_IDS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}


@dataclass(frozen=True, eq=False)
class GemmaImage:
    """One prepared image: its patches row-major and their (x, y) in its patch grid."""

    pixel_values: torch.Tensor  # [P, 3·patch²] fp32 in [0, 1] (rescaled, maybe normalised)
    positions: torch.Tensor  # [P, 2] int64


@dataclass(frozen=True)
class Gemma4Images:
    """A tensorfold.family.media.MediaProcessor for Gemma 4's vision tower."""

    settings: ImageSettings
    placeholder: str
    placeholder_id: int
    begin_id: int  # begin-of-image (boi_token_id)
    end_id: int  # end-of-image (eoi_token_id)
    block: bool
    kinds: frozenset[str] = frozenset({"image"})

    @property
    def max_rows(self) -> int:
        """The most rows an image fills (the processor's max_soft_tokens)."""
        return self.settings.max_soft_tokens

    def prepare_image(self, image: "Image") -> tuple[GemmaImage, int]:
        """An RGB image's patches and its soft-token count; MediaRefused for one the processor
        cannot fit to its patches (a side too thin to resize)."""
        try:
            batch = preprocess([image], self.settings)
        except ValueError as e:
            raise MediaRefused(f"gemma4 cannot prepare the image: {e}") from None
        rows = batch.soft_tokens[0]
        patches = rows * self.settings.pooling_kernel_size**2
        inputs = GemmaImage(
            batch.pixel_values[0, :patches].clone(), batch.image_position_ids[0, :patches].clone()
        )
        return inputs, rows

    def image_ids(self, rows: int) -> tuple[list[int], int]:
        return [self.begin_id, *[self.placeholder_id] * rows, self.end_id], 1


def media_processor(folder: Path | None, config: Mapping[str, Any]) -> Gemma4Images | None:
    """The hook's answer for a Gemma 4 checkpoint: None without a vision_config. `folder` None
    (a demo or dummy model): the image processor's and tokenizer's defaults. Refuses settings
    the tower would not take (patch size, pooling) and an image token id the tokenizer lacks."""
    source = "config.json" if folder is None else str(Path(folder) / "config.json")
    vision = vision_config(config, source)
    if vision is None:
        return None
    text = config.get("text_config") or {}
    ids = {key: int(config.get(key, default)) for key, default in DEFAULT_IDS.items()}
    if folder is None:
        settings = ImageSettings(
            patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size
        )
        placeholder = IMAGE_TOKEN
    else:
        settings = ImageSettings.from_folder(Path(folder))
        placeholder = token_text(Path(folder), ids["image_token_id"])
    if (settings.patch_size, settings.pooling_kernel_size) != (
        vision.patch_size,
        vision.pooling_kernel_size,
    ):
        raise ConfigError(
            f"{folder}: the image processor's patch_size {settings.patch_size} and "
            f"pooling_kernel_size {settings.pooling_kernel_size} differ from the vision tower's "
            f"{vision.patch_size} and {vision.pooling_kernel_size}"
        )
    return Gemma4Images(
        settings=settings,
        placeholder=placeholder,
        placeholder_id=ids["image_token_id"],
        begin_id=ids["boi_token_id"],
        end_id=ids["eoi_token_id"],
        block=text.get("use_bidirectional_attention") == "vision",
    )


def token_text(folder: Path, token_id: int) -> str:
    """The text of token `token_id` in the folder's tokenizer.json (an added token, or the
    vocabulary's), which the chat template writes for an image."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no tokenizer.json to name the image token {token_id}")
    raw = json.loads(path.read_text())
    for added in raw.get("added_tokens") or []:
        if added.get("id") == token_id:
            return str(added["content"])
    vocab = (raw.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list) and 0 <= token_id < len(vocab):  # Unigram: [piece, score] by id
        return str(vocab[token_id][0])
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if i == token_id:
                return str(text)
    raise ConfigError(f"{path}: no token has the image_token_id {token_id} of config.json")
