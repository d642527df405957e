"""glm5_next's vision tower on the GPU (`pytest -m gpu`): torch's fused attention and the Triton
products against the CPU path (fp32 within 1e-4 relative, bf16 loosely); an image's rows the
same bits alone and beside another; and at GLM-5.3-Flash's vision shape (vision_dummy.REAL) in
bf16, the device memory one tower pass takes at the largest image within what the memory plan
sets aside for it (vision_memory.tower_activation_bytes)."""

from __future__ import annotations

import pytest
import torch

from tensorfold.testing import rel_err
from tensorfold_glm.vision import image_embeddings
from tensorfold_glm.vision_config import VisionConfig
from tensorfold_glm.vision_dummy import REAL, dummy_vision_weights
from tensorfold_glm.vision_memory import DEFAULT_MAX_ROWS, tower_activation_bytes

pytestmark = pytest.mark.gpu

SMALL = VisionConfig(
    depth=2,
    hidden_size=128,
    num_heads=4,
    intermediate_size=256,
    out_hidden_size=128,
    projection_intermediate_size=192,
)
GRIDS = [[1, 16, 24], [1, 30, 10]]  # 96 and 75 rows


def pixels(cfg: VisionConfig, grids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids)
    gen = torch.Generator().manual_seed(3)
    return torch.randn(int(grid.prod(-1).sum()), cfg.patch_dim, generator=gen), grid


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_the_tower_on_cuda_is_the_cpu_tower(dtype: torch.dtype, tol: float) -> None:
    cpu = dummy_vision_weights(SMALL, "cpu", torch.float32, seed=5)
    cuda = dummy_vision_weights(SMALL, "cuda", dtype, seed=5)
    x, grid = pixels(SMALL, GRIDS)
    want = image_embeddings(cpu, x, grid)
    got = image_embeddings(cuda, x.cuda(), grid).float().cpu()
    assert rel_err(got, want) < tol
    alone = image_embeddings(cuda, x[: 16 * 24].cuda(), grid[:1])
    assert torch.equal(image_embeddings(cuda, x.cuda(), grid)[: alone.shape[0]], alone)


def test_the_plan_covers_the_towers_memory_at_the_largest_image() -> None:
    weights = dummy_vision_weights(REAL, "cuda", torch.bfloat16)
    side = int(DEFAULT_MAX_ROWS**0.5) * REAL.spatial_merge_size  # ~ the largest square image
    grid = torch.tensor([[1, side, side]])
    x = torch.randn(side * side, REAL.patch_dim, device="cuda")
    rows = side * side // REAL.spatial_merge_size**2
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = image_embeddings(weights, x, grid)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    assert out.shape == (rows, REAL.out_hidden_size) and bool(out.isfinite().all())
    bound = tower_activation_bytes(REAL, rows, 2)
    print(f"tower peak {peak / 2**30:.2f} GiB at {rows} rows; the plan's bound {bound / 2**30:.2f}")
    assert peak <= bound
