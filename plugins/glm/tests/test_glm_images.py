"""Image prompts through the runner against transformers 5.23.0's
`Glm5NextForConditionalGeneration` (fp32, the tiny checkpoint's one-block tower perturbed):
every prompt row's logits within 1e-4 relative with one image and with two of different sizes;
the prompt fed in two passes cut inside an image gives one pass's bits, and beside a text
prompt in one pass its bits alone; the images' rows are what the hook's processor
(media_processor.py) and `expand_media` put in the prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece, expand_media, media_key
from tensorfold.testing import rel_err
from tensorfold_glm.media_processor import media_processor
from tensorfold_glm.model import load

Image = pytest.importorskip("PIL.Image")

TOL = 1e-4
BEGIN, PLACEHOLDER, END = 252, 250, 253  # conftest.MM_IDS
SIZES = [(90, 60), (200, 130)]  # (width, height): 20 and 40 rows


@pytest.fixture(scope="module")
def case(tiny_paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(the reference, our model, the hook's processor) on the tiny checkpoint, its tower's
    weights perturbed (the reference initialises norms to ones and biases to zeros)."""
    from transformers import Glm5NextForConditionalGeneration

    ref = Glm5NextForConditionalGeneration.from_pretrained(tiny_paths["glm_tiny"]).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for p in ref.model.visual.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0, 1.5 / p[0].numel() ** 0.5)
    folder = tmp_path_factory.mktemp("glm_images")
    ref.save_pretrained(folder)
    ckpt = Checkpoint.open(folder)
    processor = media_processor(folder, ckpt.config)
    assert processor is not None
    return ref, load(ckpt, "cpu", "float32"), processor


def picture(width: int, height: int, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.frombytes("RGB", (width, height), values.numpy().tobytes())


def image_prompt(processor: Any, count: int) -> tuple[list[int], list[MediaPiece]]:
    """Text, then `count` images each between begin- and end-of-image, as the chat template
    writes them, expanded by expand_media."""
    gen = torch.Generator().manual_seed(count)
    text = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (21, 13, 9)]
    ids = text[0]
    images = []
    for i, (w, h) in enumerate(SIZES[:count]):
        ids = ids + [BEGIN, PLACEHOLDER, END] + text[i + 1]
        inputs, rows = processor.prepare_image(picture(w, h, i))
        images.append((inputs, rows, media_key(i)))
    return expand_media(ids, processor, images)


def reference_logits(ref: Any, ids: list[int], pieces: Sequence[MediaPiece]) -> torch.Tensor:
    pixels = torch.cat([p.inputs.pixel_values for p in pieces])
    grid = torch.tensor([p.inputs.grid_thw for p in pieces])
    with torch.no_grad():
        out = ref(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid)
    return out.logits[0].float()


def embeds_within(
    pieces: Sequence[MediaPiece], rows: Sequence[torch.Tensor], a: int, b: int
) -> list[tuple[int, torch.Tensor]]:
    """The image rows inside prompt rows [a, b): (first position, its rows)."""
    out = []
    for piece, values in zip(pieces, rows):
        lo, hi = max(a, piece.start), min(b, piece.end)
        if lo < hi:
            out.append((lo, values[lo - piece.start : hi - piece.start]))
    return out


def our_logits(
    model: Any, ids: list[int], pieces: Sequence[MediaPiece], cuts: Sequence[int], images=True
) -> torch.Tensor:
    """Every prompt row's logits, the prompt fed in runs cuts[k]:cuts[k+1], each run with the
    image rows it holds (none when not `images`: the placeholders' own embeddings)."""
    runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512)
    stream = open_stream(runner, 0, len(ids))
    rows = model.encode_media(pieces)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        run = stream.rows(ids[a:b], logits="all")
        if images:
            run = dataclasses.replace(run, embeds=embeds_within(pieces, rows, a, b))
        out.append(runner.run([run])[0])
    return torch.cat(out)


@pytest.mark.parametrize("count", [1, 2], ids=["one_image", "two_images"])
def test_image_prompts_match_transformers(case: Any, count: int) -> None:
    ref, model, processor = case
    ids, pieces = image_prompt(processor, count)
    assert [p.rows for p in pieces] == [20, 40][:count]
    for p in pieces:  # the template's begin/end around the placeholders expand_media wrote
        assert ids[p.start - 1] == BEGIN and ids[p.end] == END
        assert set(ids[p.start : p.end]) == {PLACEHOLDER}
    want = reference_logits(ref, ids, pieces)
    got = our_logits(model, ids, pieces, [0, len(ids)])
    assert got.shape == want.shape
    assert rel_err(got, want) < TOL
    # the images decide the logits: their placeholders' own embeddings give others
    assert rel_err(our_logits(model, ids, pieces, [0, len(ids)], images=False), want) > 1e-2


def test_a_pass_cut_inside_an_image_changes_no_bit(case: Any) -> None:
    _, model, processor = case
    ids, pieces = image_prompt(processor, 2)
    whole = our_logits(model, ids, pieces, [0, len(ids)])
    first, second = pieces
    for cut in (first.start + 5, second.start + 17, second.end - 1):
        assert torch.equal(our_logits(model, ids, pieces, [0, cut, len(ids)]), whole), cut


@pytest.mark.parametrize("max_rows", [8000, 20], ids=["one_pass", "a_pass_each"])
def test_images_in_one_tower_pass_encode_as_each_alone(
    case: Any, max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two images of 20 and 40 rows through the tower together (or, within 20 rows a pass,
    one a pass): each one's rows the bits it has alone."""
    import tensorfold_glm.model as glm_model

    _, model, processor = case
    _, pieces = image_prompt(processor, 2)
    monkeypatch.setattr(glm_model, "DEFAULT_MAX_ROWS", max_rows)
    both = model.encode_media(pieces)
    for piece, rows in zip(pieces, both):
        assert torch.equal(model.encode_media([piece])[0], rows)
    assert [r.shape for r in both] == [(p.rows, 64) for p in pieces]
    assert all(r.dtype == torch.float32 for r in both)


def test_a_piece_whose_rows_differ_from_its_image_is_refused(case: Any) -> None:
    _, model, processor = case
    _, (piece,) = image_prompt(processor, 1)
    with pytest.raises(ValueError, match="gives 20 rows"):
        model.encode_media([dataclasses.replace(piece, rows=19)])


def test_an_image_prompt_beside_a_text_prompt_gives_its_bits_alone(case: Any) -> None:
    """Two streams in one pass, the image prompt second (its rows start past the text's): each
    stream's logits are the bits it gets alone."""
    _, model, processor = case
    ids, pieces = image_prompt(processor, 2)
    rows = model.encode_media(pieces)
    text = torch.randint(3, 250, (37,), generator=torch.Generator().manual_seed(9)).tolist()
    runner = ModelRunner(model, num_pages=4, num_slots=2, page_rows=512)
    plain, image = open_stream(runner, 0, len(text)), open_stream(runner, 1, len(ids))
    image_run = image.rows(ids, logits="all")
    image_run = dataclasses.replace(image_run, embeds=embeds_within(pieces, rows, 0, len(ids)))
    together = runner.run([plain.rows(text, logits="all"), image_run])
    assert torch.equal(together[1], our_logits(model, ids, pieces, [0, len(ids)]))
    runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512)
    alone = runner.run([open_stream(runner, 0, len(text)).rows(text, logits="all")])[0]
    assert torch.equal(together[0], alone)
