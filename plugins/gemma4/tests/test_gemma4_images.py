"""gemma4 answers image prompts: every prompt row's logits through the runner (the tower's rows
over the placeholders, the sliding layers' image blocks bidirectional) against transformers
5.23.0's Gemma4ForConditionalGeneration with 1 and 2 images of different sizes, fp32, <= 1e-4
relative. The tiny config has per-layer embeddings, KV-sharing layers (a sliding and a full one)
and `use_bidirectional_attention: "vision"`, its window (8) shorter than the larger image (12
rows). The prompt cut at an image's first row gives the bits of one pass; without the blocks'
`attend_upto` the image rows come out otherwise (the parity test can fail). The sliding layers
on the Triton ring kernel (TRITON_INTERPRET=1) give the torch path's logits and the same cut
bits."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads: its kernels on the CPU

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece, expand_media
from tensorfold.testing import rel_err
from tensorfold_gemma4.media import GemmaImage, media_processor
from tensorfold_gemma4.model import Gemma4Model, load

PATCH, K = 4, 3  # patch_size, pooling_kernel_size
GRIDS = ((12, 9), (6, 3))  # (rows, columns) of patches: 4x3 and 2x1 soft tokens
MAX_PATCHES = max(r * c for r, c in GRIDS)
IDS = dict(image_token_id=250, video_token_id=251, audio_token_id=252, boi_token_id=253)
S, F = "sliding_attention", "full_attention"


def _reference(folder: Path) -> Any:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(
        vocab_size=256,
        vocab_size_per_layer_input=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        sliding_window=8,
        layer_types=[S, F, S, S, F],
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,  # layer 3 reads layer 2's rings, layer 4 layer 1's pages
        final_logit_softcapping=30.0,
        use_bidirectional_attention="vision",
        initializer_range=0.1,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        pooling_kernel_size=K,
        position_embedding_size=16,
        standardize=True,
    )
    torch.manual_seed(11)
    ref = Gemma4ForConditionalGeneration(
        Gemma4Config(
            text_config=text, vision_config=vision, audio_config=None, eoi_token_id=254, **IDS
        )
    ).eval()
    gen = torch.Generator().manual_seed(12)
    with torch.no_grad():  # ones-, zero- or empty-initialised tensors made non-trivial
        for name, p in ref.named_parameters():
            if "norm" in name or "position_embedding" in name or "std_" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
        for name, b in ref.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.7 + 0.3 * torch.rand(b.shape, generator=gen))
    ref.save_pretrained(folder)
    return ref


def _images(grids: tuple[tuple[int, int], ...]) -> list[GemmaImage]:
    """Random images laid out as Gemma 4's processor lays them: patches row-major, (x, y)."""
    gen = torch.Generator().manual_seed(13)
    out = []
    for rows, cols in grids:
        ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        pixels = torch.rand(rows * cols, 3 * PATCH * PATCH, generator=gen)
        out.append(GemmaImage(pixels, torch.stack((xs.reshape(-1), ys.reshape(-1)), dim=-1)))
    return out


def _prompt(config: dict[str, Any], count: int) -> tuple[list[int], list[MediaPiece]]:
    """Text, then the first `count` images' placeholder tokens with text after each, expanded as
    the core expands them (begin-of-image, a row per soft token, end-of-image)."""
    gen = torch.Generator().manual_seed(14)
    ids = [2]
    for _ in range(count):
        ids += torch.randint(3, 249, (9,), generator=gen).tolist() + [IDS["image_token_id"]]
    ids += torch.randint(3, 249, (5,), generator=gen).tolist()
    processor = media_processor(None, config)
    assert processor is not None and processor.block
    images = [
        (image, (r // K) * (c // K), 1 + i)
        for i, (image, (r, c)) in enumerate(zip(_images(GRIDS[:count]), GRIDS))
    ]
    return expand_media(ids, processor, images)


@dataclasses.dataclass
class Case:
    ref: Any  # Gemma4ForConditionalGeneration
    model: Gemma4Model
    config: dict[str, Any]  # its config.json


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    folder = tmp_path_factory.mktemp("gemma4_images")
    ref = _reference(folder)
    ckpt = Checkpoint.open(folder)
    return Case(ref, load(ckpt, "cpu", "float32"), ckpt.config)


def _ref_logits(ref: Any, ids: list[int], count: int) -> torch.Tensor:
    images = _images(GRIDS[:count])
    pixels = torch.zeros(len(images), MAX_PATCHES, 3 * PATCH * PATCH)
    positions = torch.full((len(images), MAX_PATCHES, 2), -1, dtype=torch.long)
    for i, image in enumerate(images):
        n = image.positions.shape[0]
        pixels[i, :n], positions[i, :n] = image.pixel_values, image.positions
    x = torch.tensor([ids])
    with torch.no_grad():
        return ref(
            input_ids=x,
            pixel_values=pixels,
            image_position_ids=positions,
            mm_token_type_ids=(x == IDS["image_token_id"]).long(),
        ).logits[0]


def _ours(
    model: Gemma4Model, ids: list[int], pieces: list[MediaPiece], cuts: list[int] | None = None
) -> torch.Tensor:
    """Every prompt row's logits through a fresh runner, the prompt in runs cut at `cuts`."""
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    stream = open_stream(runner, 0, len(ids))
    embeds = list(zip((p.start for p in pieces), model.encode_media(pieces)))
    cuts = [0, *(cuts or []), len(ids)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        run = stream.rows(ids[a:b], logits="all")
        run = dataclasses.replace(
            run,
            embeds=[(at, e) for at, e in embeds if a <= at < b],
            blocks=[(p.start, p.end) for p in pieces if p.block and a <= p.start < b],
        )
        out.append(runner.run([run])[0])
    stream.lease.release()
    return torch.cat(out)


@pytest.mark.parametrize("count", [1, 2], ids=["one_image", "two_images"])
def test_image_prompts_match_the_reference(case: Case, count: int) -> None:
    ids, pieces = _prompt(case.config, count)
    assert [p.rows for p in pieces] == [12, 2][:count]
    want = _ref_logits(case.ref, ids, count)
    got = _ours(case.model, ids, pieces)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4


def test_without_the_blocks_the_image_rows_differ(case: Case) -> None:
    """The same prompt with the sliding layers causal inside the image: far from the reference
    (so the parity test above can fail), equal before the image."""
    ids, pieces = _prompt(case.config, 1)
    want = _ref_logits(case.ref, ids, 1)
    causal = copy.copy(case.model)
    causal.cfg = dataclasses.replace(case.model.cfg, vision_blocks=False)
    got = _ours(causal, ids, pieces)
    start = pieces[0].start
    assert rel_err(got[:start], want[:start]) <= 1e-4
    assert rel_err(got[start:], want[start:]) > 1e-2


def test_a_prompt_cut_at_an_image_gives_the_bits_of_one_pass(case: Case) -> None:
    ids, pieces = _prompt(case.config, 2)
    whole = _ours(case.model, ids, pieces)
    assert torch.equal(_ours(case.model, ids, pieces, cuts=[pieces[0].start]), whole)
    assert torch.equal(_ours(case.model, ids, pieces, cuts=[p.start for p in pieces]), whole)


def test_an_image_s_rows_do_not_depend_on_the_other_images(case: Case) -> None:
    _, pieces = _prompt(case.config, 2)
    both = case.model.encode_media(pieces)
    assert [tuple(e.shape) for e in both] == [(12, 64), (2, 64)]
    assert torch.equal(case.model.encode_media(pieces[1:])[0], both[1])
    with pytest.raises(ValueError, match="holds 3 rows"):
        case.model.encode_media([dataclasses.replace(pieces[1], rows=3)])


def test_through_the_attention_kernels(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sliding layers on the Triton ring kernel (with the image blocks' upto), the other ops
    on torch: the torch path's logits, and a cut at each image giving one pass's bits."""
    pytest.importorskip("triton", reason="the Triton kernels need triton")
    from tensorfold.ops import window_attention

    ids, pieces = _prompt(case.config, 2)
    want = _ours(case.model, ids, pieces)
    monkeypatch.setattr(window_attention, "use_triton", lambda t: True)
    got = _ours(case.model, ids, pieces)
    assert rel_err(got, want) < 1e-5
    assert torch.equal(_ours(case.model, ids, pieces, cuts=[p.start for p in pieces]), got)
