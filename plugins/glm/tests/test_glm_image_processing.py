"""The image preprocessing (image_processing.py) against transformers 5.23.0's
`Glm5NextImageProcessorPil`: pixel values bit for bit, grid_thw and the image-token counts, for
two small images (one grown to the minimum, one with transparency) and, under a small
max_image_tokens, two shrunk ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tensorfold_glm.image_processing import ImageProcessor

Image = pytest.importorskip("PIL.Image")


def picture(width: int, height: int, mode: str, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    bands = len(mode)
    values = torch.randint(0, 256, (height, width, bands), generator=gen, dtype=torch.uint8)
    # smooth gradients plus noise: resampling has something to interpolate
    ramp = (torch.arange(width)[None, :, None] * 3 + torch.arange(height)[:, None, None]) % 256
    values = ((values.int() // 4 + ramp) % 256).to(torch.uint8)
    return Image.frombytes(mode, (width, height), values.numpy().tobytes())


@pytest.mark.parametrize(
    "settings, sizes",
    [
        ({}, [(50, 70), (130, 90)]),
        ({"max_image_tokens": 12, "min_image_tokens": 4}, [(300, 200), (90, 410)]),
    ],
    ids=["defaults", "shrunk"],
)
def test_preprocessing_matches_transformers(
    settings: dict[str, Any], sizes: list[tuple[int, int]]
) -> None:
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    images = [
        picture(w, h, mode, i) for i, ((w, h), mode) in enumerate(zip(sizes, ["RGB", "RGBA"]))
    ]
    ref = Glm5NextImageProcessorPil(**settings)
    want = ref(images, return_tensors="pt")
    got = ImageProcessor.from_dict(settings)(images)
    assert torch.equal(got.grid_thw, want["image_grid_thw"])
    assert got.pixel_values.dtype == want["pixel_values"].dtype == torch.float32
    assert torch.equal(got.pixel_values, want["pixel_values"])
    merge2 = ref.merge_size**2
    counts = [ref.get_number_of_image_patches(h, w, settings) // merge2 for w, h in sizes]
    assert got.token_counts == counts
    ours = ImageProcessor.from_dict(settings)
    assert [ours.token_count(h, w) for w, h in sizes] == counts


def test_settings_come_from_preprocessor_config(tmp_path: Any) -> None:
    (tmp_path / "preprocessor_config.json").write_text(
        '{"max_image_tokens": 64, "image_mean": [0.5, 0.5, 0.5], "patch_size": 16}'
    )
    proc = ImageProcessor.from_folder(tmp_path)
    assert (proc.max_image_tokens, proc.image_mean, proc.patch_size) == (64, (0.5,) * 3, 16)
    assert ImageProcessor.from_folder(tmp_path / "absent") == ImageProcessor()
