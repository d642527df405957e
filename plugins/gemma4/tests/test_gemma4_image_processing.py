"""gemma4's image preprocessing (image_processing.py) against transformers 5.23.0's
Gemma4ImageProcessorPil, its settings read back from the folder it saves: pixel values, patch
positions and soft-token counts of two small images (one upscaled RGB, one wide RGBA) equal."""

from __future__ import annotations

from pathlib import Path

import torch

from tensorfold_gemma4.image_processing import ImageSettings, preprocess


def _images() -> list:
    from PIL import Image

    gen = torch.Generator().manual_seed(8)
    rgb = torch.randint(0, 256, (50, 37, 3), dtype=torch.uint8, generator=gen)
    rgba = torch.randint(0, 256, (20, 90, 4), dtype=torch.uint8, generator=gen)
    return [
        Image.frombytes("RGB", (37, 50), bytes(rgb.flatten().tolist())),
        Image.frombytes("RGBA", (90, 20), bytes(rgba.flatten().tolist())),
    ]


def test_preprocessing_matches_the_processor(tmp_path: Path) -> None:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    ref = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    ref.save_pretrained(tmp_path)
    settings = ImageSettings.from_folder(tmp_path)
    assert (settings.patch_size, settings.max_soft_tokens) == (4, 70)
    images = _images()
    want = ref(images, return_tensors="pt")
    got = preprocess(images, settings)
    assert got.soft_tokens == want["num_soft_tokens_per_image"].tolist() == [63, 51]
    assert torch.equal(got.image_position_ids, want["image_position_ids"].long())
    assert got.pixel_values.dtype == want["pixel_values"].dtype
    assert torch.equal(got.pixel_values, want["pixel_values"])
