"""gemma4's vision tower (vision.py) against transformers 5.23.0's `get_image_features` on a tiny
Gemma4ForConditionalGeneration with a vision_config, saved and loaded back: 1 and 2 images of
different sizes, fp32, <= 1e-4 relative. Inputs are laid out as Gemma 4's image processor lays
them (patches row-major, (x, y) positions, zero padding with (-1, -1))."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gemma4_media_configs import MEDIA_IDS, TINY_TEXT

from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece
from tensorfold_gemma4.media import GemmaImage
from tensorfold_gemma4.model import load
from tensorfold_gemma4.vision import image_soft_tokens, images_embeddings

PATCH, K = 4, 3  # patch_size, pooling_kernel_size
MAX_PATCHES = 8 * K * K  # max_soft_tokens 8
GRIDS = ((6, 9), (9, 3))  # (rows, columns) of patches: 2x3 and 3x1 soft tokens


def _reference(folder: Path) -> Any:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(TINY_TEXT)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped
        head_dim=8,
        patch_size=PATCH,
        pooling_kernel_size=K,
        position_embedding_size=16,
        standardize=True,
    )
    torch.manual_seed(5)
    ref = Gemma4ForConditionalGeneration(
        Gemma4Config(
            text_config=text,
            vision_config=vision,
            audio_config=None,
            **MEDIA_IDS,
        )
    ).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # ones-, zero- or empty-initialised tensors made non-trivial
        tower = ref.model.vision_tower
        for name, p in tower.named_parameters():
            if "norm" in name or "position_embedding" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        tower.std_bias.copy_(0.5 * torch.randn(tower.std_bias.shape, generator=gen))
        tower.std_scale.copy_(1 + 0.3 * torch.randn(tower.std_scale.shape, generator=gen))
    ref.save_pretrained(folder)
    return ref


def _images(grids: tuple[tuple[int, int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [B, MAX_PATCHES, 3·PATCH²] in [0, 1] and positions [B, MAX_PATCHES, 2]."""
    gen = torch.Generator().manual_seed(7)
    pixels = torch.zeros(len(grids), MAX_PATCHES, 3 * PATCH * PATCH)
    positions = torch.full((len(grids), MAX_PATCHES, 2), -1, dtype=torch.long)
    for i, (rows, cols) in enumerate(grids):
        n = rows * cols
        pixels[i, :n] = torch.rand(n, 3 * PATCH * PATCH, generator=gen)
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        positions[i, :n] = torch.stack((xs.reshape(-1), ys.reshape(-1)), dim=-1)
    return pixels, positions


@pytest.fixture(scope="module")
def tower_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    folder = tmp_path_factory.mktemp("gemma4_vision")
    return _reference(folder), folder


@pytest.fixture(scope="module")
def tower(tower_folder: tuple[Any, Path]) -> tuple[Any, Any]:
    ref, folder = tower_folder
    return ref, load(Checkpoint.open(folder), "cpu", "float32")


@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS], ids=["one_image", "two_images"])
def test_soft_tokens_match_the_reference(tower: tuple[Any, Any], grids: Any) -> None:
    ref, model = tower
    pixels, positions = _images(grids)
    with torch.no_grad():
        want = torch.cat(ref.get_image_features(pixels, positions).pooler_output)
        got = image_soft_tokens(model.vision_cfg, model.vision_weights, pixels, positions)
    tokens = sum((r // K) * (c // K) for r, c in grids)
    assert got.shape == want.shape == (tokens, 64)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_each_image_in_one_tower_pass_is_the_image_alone(
    tower_folder: tuple[Any, Path], dtype: str
) -> None:
    """Three images of 54, 27 and 54 patches in one pass (the second starts inside a product's
    row block): each one's soft tokens the bits it has alone, through encode_media too."""
    model = load(Checkpoint.open(tower_folder[1]), "cpu", dtype)
    cfg, w = model.vision_cfg, model.vision_weights
    grids = (*GRIDS, GRIDS[0][::-1])
    pixels, positions = _images(grids)
    together = images_embeddings(cfg, w, list(zip(pixels, positions)))
    pieces = []
    for i, (px, pos) in enumerate(zip(pixels, positions)):
        alone = images_embeddings(cfg, w, [(px, pos)])[0]
        assert torch.equal(together[i], alone), i
        valid = (pos != -1).any(-1)
        image = GemmaImage(px[valid], pos[valid])
        pieces.append(MediaPiece(start=10 * i, rows=alone.shape[0], key=i + 1, inputs=image))
    encoded = model.encode_media(pieces)
    for i, rows in enumerate(encoded):
        assert torch.equal(rows, together[i].to(model.dtype)), i


def test_a_text_only_checkpoint_has_no_tower(tiny_paths: dict[str, Path]) -> None:
    model = load(Checkpoint.open(tiny_paths["e_style"]), "cpu", "float32")
    assert model.vision_cfg is None and model.vision_weights is None
