"""glm5_next's images on the GPU (`pytest -m gpu`): the vision tower's fused attention and Triton
products against the CPU path (fp32 within 1e-4 relative, bf16 loosely); each image's rows in a
pass of three the same bits as alone; at GLM-5.3-Flash's vision shape (vision_dummy.REAL) in
bf16, the device memory one tower pass takes at the largest image within what the memory plan
sets aside for it (vision_memory.tower_activation_bytes); and the vision demo's image prompts
through the runner in bf16 (the Triton kernels): a pass cut inside an image gives one pass's
bits, beside a text prompt the same bits as alone, and the logits near the CPU's fp32."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

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


def moved(weights: Any, dtype: torch.dtype) -> Any:
    """The CPU's weights on CUDA in dtype (a device's generator draws other numbers)."""
    out = {}
    for f in dataclasses.fields(weights):
        v = getattr(weights, f.name)
        if isinstance(v, torch.Tensor):
            v = v.to("cuda", dtype)
        elif isinstance(v, list):
            v = [moved(b, dtype) for b in v]
        out[f.name] = v
    return dataclasses.replace(weights, **out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_the_tower_on_cuda_is_the_cpu_tower(dtype: torch.dtype, tol: float) -> None:
    cpu = dummy_vision_weights(SMALL, "cpu", torch.float32, seed=5)
    cuda = moved(cpu, dtype)
    x, grid = pixels(SMALL, GRIDS)
    want = image_embeddings(cpu, x, grid)
    got = image_embeddings(cuda, x.cuda(), grid).float().cpu()
    assert rel_err(got, want) < tol
    three = [[1, 6, 10], *GRIDS]  # the others start 60 and 444 patches in: inside a tile
    x, grid = pixels(SMALL, three)
    together = image_embeddings(cuda, x.cuda(), grid).split([g[1] * g[2] // 4 for g in three])
    for i, rows in enumerate(x.split([g[1] * g[2] for g in three])):
        assert torch.equal(together[i], image_embeddings(cuda, rows.cuda(), grid[i : i + 1])), i


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


def image_prompt(folder: Path) -> tuple[list[int], Any]:
    from tensorfold.family.chat_template import render_chat
    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold.family.media import expand_media
    from tensorfold.family.tokenizer import Tokenizer
    from tensorfold_glm.media_processor import media_processor

    Image = pytest.importorskip("PIL.Image")
    ckpt = Checkpoint.open(folder)
    tok, processor = Tokenizer.from_checkpoint(ckpt), media_processor(folder, ckpt.config)
    assert processor is not None
    parts = [
        {"type": "text", "text": "Look: " * 40},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text = render_chat(tok.chat_template or "", [{"role": "user", "content": parts}]).text
    image = Image.new("RGB", (300, 200), (120, 30, 200))
    inputs, rows = processor.prepare_image(image)
    ids, (piece,) = expand_media(tok.encode(text), processor, [(inputs, rows, 1)])
    return ids, piece


def test_the_vision_demos_image_prompts_on_the_gpu(tmp_path: Path) -> None:
    from tensorfold.engine.runner import ModelRunner, open_stream
    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold_glm.model import load
    from tensorfold_glm.vision_demo import write_vision_demo

    folder = write_vision_demo(tmp_path / "ckpt")
    ids, piece = image_prompt(folder)
    # text either side; the GPU's KDA takes whole 64-row chunks, so passes are cut on multiples
    # of 64 (the lanes' mark_rows), here inside the image
    inside = [c for c in range(64, len(ids), 64) if piece.start < c < piece.end]
    assert piece.start > 64 and piece.end < len(ids) and inside

    def logits(model: Any, cuts: list[int], text: list[int] | None = None) -> torch.Tensor:
        runner = ModelRunner(model, num_pages=4, num_slots=2, page_rows=512)
        (rows,) = model.encode_media([piece])
        stream, out = open_stream(runner, 0, len(ids)), []
        for a, b in zip(cuts, cuts[1:]):
            lo, hi = max(a, piece.start), min(b, piece.end)
            embeds = [(lo, rows[lo - piece.start : hi - piece.start])] if lo < hi else []
            run = dataclasses.replace(stream.rows(ids[a:b], logits="all"), embeds=embeds)
            runs = [run]
            if text is not None and a == 0:  # a text stream beside the image prompt's first run
                runs.insert(0, open_stream(runner, 1, len(text)).rows(text, logits="all"))
            out.append(runner.run(runs)[-1])
        return torch.cat(out)

    gpu = load(Checkpoint.open(folder), "cuda", "bfloat16")
    whole = logits(gpu, [0, len(ids)])
    for cut in inside:
        assert torch.equal(logits(gpu, [0, cut, len(ids)]), whole), cut
    assert torch.equal(logits(gpu, [0, 64, inside[0], len(ids)]), whole)
    assert torch.equal(logits(gpu, [0, len(ids)], text=list(range(20, 120))), whole)
    cpu = logits(load(Checkpoint.open(folder), "cpu", "float32"), [0, len(ids)])
    agree = (whole.float().cpu().argmax(-1) == cpu.argmax(-1)).float().mean().item()
    print(f"bf16 GPU against fp32 CPU: argmax agrees on {agree:.3f} of the rows")
    assert agree >= 0.75  # bf16 against fp32: most rows (the tower is random, its rows noise)
