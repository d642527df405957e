"""The vision tower (vision.py, vision_weights.py) against transformers 5.23.0's
`get_image_features` on the tiny checkpoint's one-block tower, its weights perturbed (the
reference initialises norms to ones, biases to zeros and maps small), saved and loaded back: 1 and 2 images
of different grids, fp32, within 1e-4 relative; each image's rows in a pass of three the bits it
has alone;
the CPU attention in query blocks; the memory plan's count of the tower (vision_memory.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold.family.checkpoint import Checkpoint
from tensorfold_glm import vision_memory
from tensorfold_glm.image_processing import ImageProcessor
from tensorfold_glm.layout import shape
from tensorfold_glm.vision import attend, image_embeddings, image_token_counts, query_rows
from tensorfold_glm.vision_memory import (
    DEFAULT_MAX_ROWS,
    tower_activation_bytes,
    tower_weight_bytes,
)
from tensorfold_glm.vision_weights import VisionConfig, load_vision_weights

GRIDS = [[1, 4, 6], [1, 2, 2]]  # t, h, w in patches: 24 and 4 patches, 6 and 1 tokens


@pytest.fixture(scope="module")
def tower(tiny_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(the reference model, our weights, the checkpoint folder)."""
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(tiny_paths["glm_tiny"]).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in ref.model.visual.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:  # unit-scale products, so the clamps and the GELU's curve take part
                p.normal_(0, 1.5 / p[0].numel() ** 0.5)
    folder = tmp_path_factory.mktemp("glm_vision")
    ref.save_pretrained(folder)
    weights = load_vision_weights(Checkpoint.open(folder), "cpu", torch.float32)
    assert weights is not None
    return ref, weights, folder


def pixels(grids: list[list[int]], cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    gen = torch.Generator().manual_seed(sum(sum(g) for g in grids))
    rows = int(grid.prod(-1).sum())
    return torch.randn(rows, cfg.patch_dim, generator=gen) * 1.5, grid


def reference(ref: Any, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = ref.model.get_image_features(pixel_values, grid, return_dict=True)
    return torch.cat(out.pooler_output)


@pytest.mark.parametrize("grids", [GRIDS[:1], GRIDS], ids=["one_image", "two_images"])
def test_image_embeddings_match_transformers(tower: Any, grids: list[list[int]]) -> None:
    ref, weights, _ = tower
    pixel_values, grid = pixels(grids, weights.cfg)
    want = reference(ref, pixel_values, grid)
    got = image_embeddings(weights, pixel_values, grid)
    assert got.shape == want.shape == (sum(image_token_counts(grid, weights.cfg)), 64)
    assert want.std() > 0.1  # the tower's output is not degenerate
    err = (got - want).abs().max() / want.abs().max()
    assert err <= 1e-4, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_image_in_one_tower_pass_is_the_image_alone(tower: Any, dtype: torch.dtype) -> None:
    """Three images of 24, 4 and 24 patches in one pass (the second and third start inside a
    product's row block): each one's rows the bits it has alone."""
    weights = load_vision_weights(Checkpoint.open(tower[2]), "cpu", dtype)
    assert weights is not None
    grids = [*GRIDS, [1, 6, 4]]
    both, grid = pixels(grids, weights.cfg)
    together = image_embeddings(weights, both, grid).split(image_token_counts(grid, weights.cfg))
    for i, rows in enumerate(both.split(grid.prod(-1).tolist())):
        alone = image_embeddings(weights, rows, grid[i : i + 1])
        assert torch.equal(together[i], alone), i


def test_bad_pixel_rows_are_refused(tower: Any) -> None:
    _, weights, _ = tower
    pixel_values, grid = pixels(GRIDS, weights.cfg)
    with pytest.raises(ValueError, match="pixel rows"):
        image_embeddings(weights, pixel_values[:-1], grid)
    with pytest.raises(ValueError, match="multiples"):
        image_embeddings(weights, pixel_values[:12], torch.tensor([[1, 3, 4]]))


def test_no_vision_config_loads_no_tower(tower: Any, tmp_path: Path) -> None:
    _, _, src = tower
    folder = Path(shutil.copytree(src, tmp_path / "text_only"))
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["vision_config"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert load_vision_weights(Checkpoint.open(folder), "cpu", torch.float32) is None


def test_vision_config_refuses_what_the_tower_does_not_compute() -> None:
    with pytest.raises(ValueError, match="hidden_act"):
        VisionConfig.from_dict({"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="axial"):
        VisionConfig.from_dict({"rope_parameters": {"rope_type": "default"}})
    assert VisionConfig.from_dict({"rope_parameters": {"rope_theta": 5.0}}).rope_theta == 5.0


def test_attention_in_query_blocks_is_the_attention(
    tower: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, weights, _ = tower
    pixel_values, grid = pixels(GRIDS, weights.cfg)
    whole = image_embeddings(weights, pixel_values, grid)
    # 2 heads x 24 patches x 4 bytes x 5 queries: blocks of 5, the last of 4
    monkeypatch.setattr(vision_memory, "SCORE_BYTES", 2 * 24 * 4 * 5)
    assert query_rows(24, 2) == 5
    blocked = image_embeddings(weights, pixel_values, grid)
    assert (blocked - whole).abs().max() <= 1e-6 * whole.abs().max()
    assert (blocked - reference(ref, pixel_values, grid)).abs().max() <= 1e-4 * whole.abs().max()


def test_the_plan_counts_the_towers_weights_and_activations(tower: Any) -> None:
    _, weights, folder = tower
    ckpt = Checkpoint.open(folder)
    visual = [n for n in ckpt.tensor_names() if n.startswith("model.visual.")]
    stored = sum(ckpt.info(n).nbytes for n in visual)  # in the start's weight bytes
    assert stored == tower_weight_bytes(weights.cfg, 4)  # the tiny checkpoint is fp32
    media = shape(ckpt.config, "float32").media_bytes
    assert media == tower_activation_bytes(weights.cfg, DEFAULT_MAX_ROWS, 4) > 0
    assert DEFAULT_MAX_ROWS == ImageProcessor().max_image_tokens  # the processor's default
    text_only = {k: v for k, v in ckpt.config.items() if k != "vision_config"}
    assert shape(text_only, "float32").media_bytes == 0
    # the bound grows with the image and the CPU's score blocks
    assert tower_activation_bytes(weights.cfg, 100, 2) < tower_activation_bytes(weights.cfg, 200, 2)
    assert tower_activation_bytes(weights.cfg, 100, 2, cuda=False) > tower_activation_bytes(
        weights.cfg, 100, 2
    )


def test_the_fused_attention_is_the_blocked_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch (torch's fused attention), run on the CPU, against the fp32 blocks."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(37, 2, 16, generator=gen) for _ in range(3))
    monkeypatch.setattr(vision_memory, "SCORE_BYTES", 2 * 37 * 4 * 8)  # blocks of 8 queries
    blocked, fused = attend(q, k, v, fused=False), attend(q, k, v, fused=True)
    assert fused.shape == blocked.shape == (37, 2, 16)
    assert (fused - blocked).abs().max() <= 1e-5 * blocked.abs().max()
