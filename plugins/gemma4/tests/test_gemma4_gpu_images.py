"""gemma4's image prompts on the GPU (`pytest -m gpu`): the vision demo (vision_demo.py) in bf16
on CUDA, its sliding layers on the Triton ring kernel with image blocks. Two images in a prompt:
beside a text prompt, alone, and cut at each image's first row, the same bits, in bf16 pages and
fp8 ones; in fp32 every row's logits close to the CPU path's. (The demo's bf16 logits are far
from its fp32 ones, text alone too: a toy model, so bf16 is held to itself.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece, expand_media
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.testing import rel_err
from tensorfold_gemma4.media import media_processor
from tensorfold_gemma4.model import load
from tensorfold_gemma4.vision_demo import write_vision_demo

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vision_demo(tmp_path_factory.mktemp("gemma4_vision_demo"))


def _prompt(folder: Path) -> tuple[list[int], list[MediaPiece]]:
    from PIL import Image

    ckpt = Checkpoint.open(folder)
    processor = media_processor(folder, ckpt.config)
    assert processor is not None
    tok = Tokenizer.from_checkpoint(ckpt)
    text = "<bos><start_of_turn>user\nOne <|image|> and two <|image|> here.<end_of_turn>\n"
    images = []
    for i, (w, h) in enumerate(((300, 200), (64, 160))):
        gen = torch.Generator().manual_seed(i)
        px = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        inputs, rows = processor.prepare_image(Image.fromarray(px, "RGB"))
        images.append((inputs, rows, 1 + i))
    return expand_media(tok.encode(text), processor, images)


def _run(
    model: Any, ids: list[int], pieces: list[MediaPiece], cuts: list[int], beside=True, **kw
) -> Any:
    """Every prompt row's logits, the prompt in runs cut at `cuts`, beside a 40-row text
    prompt in another slot in the first pass (unless not `beside`)."""
    runner = ModelRunner(model, num_pages=2, num_slots=2, page_rows=512, **kw)
    stream, other = open_stream(runner, 0, len(ids)), open_stream(runner, 1, 40)
    embeds = list(zip((p.start for p in pieces), model.encode_media(pieces)))
    bounds = [0, *cuts, len(ids)]
    out = []
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        run = dataclasses.replace(
            stream.rows(ids[a:b], logits="all"),
            embeds=[(at, e) for at, e in embeds if a <= at < b],
            blocks=[(p.start, p.end) for p in pieces if a <= p.start < b],
        )
        runs = [run, other.rows(list(range(3, 43)))] if n == 0 and beside else [run]
        out.append(runner.run(runs)[0])
    return torch.cat(out)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_image_prompts_give_the_same_bits_however_they_run(folder: Path, kv_dtype: str) -> None:
    ids, pieces = _prompt(folder)
    kw = {} if kv_dtype == "auto" else {"kv_dtype": kv_dtype}
    gpu = load(Checkpoint.open(folder), "cuda", "bfloat16")
    whole = _run(gpu, ids, pieces, [], **kw)
    assert torch.isfinite(whole).all()
    assert torch.equal(_run(gpu, ids, pieces, [], beside=False, **kw), whole)
    assert torch.equal(_run(gpu, ids, pieces, [pieces[0].start], **kw), whole)
    assert torch.equal(_run(gpu, ids, pieces, [p.start for p in pieces], **kw), whole)


def test_image_prompts_in_fp32_match_the_cpu_path(folder: Path) -> None:
    ids, pieces = _prompt(folder)
    got = _run(load(Checkpoint.open(folder), "cuda", "float32"), ids, pieces, [])
    want = _run(load(Checkpoint.open(folder), "cpu", "float32"), ids, pieces, [])
    assert rel_err(got.cpu(), want) < 1e-2
