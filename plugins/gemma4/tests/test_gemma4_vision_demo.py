"""The image-taking demo checkpoint (vision_demo.py) and gemma4's `media_processor` hook: the
folder loads in transformers 5.23.0 and in gemma4, its chat template places `<|image|>` (one
token, the config's image_token_id) where an image item goes, and a real image through the
whole path (Pillow preprocessing, the core's expand_media, the tower, the prompt pass) gives
the reference's logits for every prompt row; a text-only config takes no images."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece, expand_media
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.testing import rel_err
from tensorfold_gemma4.dummy import load_dummy
from tensorfold_gemma4.hooks import HOOKS
from tensorfold_gemma4.media import IMAGE_TOKEN, media_processor
from tensorfold_gemma4.model import load, shape
from tensorfold_gemma4.vision_config import vision_config
from tensorfold_gemma4.vision_demo import write_vision_demo


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vision_demo(tmp_path_factory.mktemp("gemma4_vision_demo"))


def _image(width: int, height: int) -> Any:
    from PIL import Image

    gen = torch.Generator().manual_seed(width)
    pixels = torch.randint(0, 256, (height, width, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB")


def test_the_hook_answers_from_the_folder(folder: Path) -> None:
    ckpt = Checkpoint.open(folder)
    processor = HOOKS.media_processor(folder, ckpt.config)
    assert processor is not None and processor.kinds == {"image"} and processor.block
    assert processor.placeholder == IMAGE_TOKEN
    assert processor.placeholder_id == ckpt.config["image_token_id"]
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.encode(IMAGE_TOKEN) == [processor.placeholder_id]
    ids, offset = processor.image_ids(3)
    assert offset == 1 and ids[1:4] == [processor.placeholder_id] * 3
    assert tok.decode([ids[0], ids[-1]], skip_special_tokens=False) == "<|image><image|>"
    # a dummy model (no folder): the tower's patch and pooling, Gemma 4's image token
    bare = media_processor(None, ckpt.config)
    assert bare is not None and bare.placeholder == IMAGE_TOKEN
    assert bare.settings.patch_size == 16 and bare.settings.max_soft_tokens == 280
    text_only = {**ckpt.config, "vision_config": None}
    assert media_processor(folder, text_only) is None
    # prompt workers are processes: the processor and a prepared image travel by pickle
    inputs, rows = pickle.loads(pickle.dumps(processor)).prepare_image(_image(20, 30))
    again = pickle.loads(pickle.dumps(inputs))
    assert torch.equal(again.pixel_values, inputs.pixel_values) and rows > 0


def test_an_image_prompt_matches_the_reference(folder: Path) -> None:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    from transformers import Gemma4ForConditionalGeneration

    ckpt = Checkpoint.open(folder)
    processor = media_processor(folder, ckpt.config)
    assert processor is not None
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.chat_template is not None
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "text", "text": "and this one"},
                {"type": "image"},
            ],
        }
    ]
    text = render_chat(tok.chat_template, messages, bos_token="<bos>").text
    assert text.count(IMAGE_TOKEN) == 2
    images = [processor.prepare_image(_image(w, h)) for w, h in ((90, 60), (40, 100))]
    ids, pieces = expand_media(
        tok.encode(text),
        processor,
        [(inputs, rows, 1 + i) for i, (inputs, rows) in enumerate(images)],
    )
    assert [p.rows for p in pieces] == [rows for _, rows in images]
    assert all(0 < p.rows <= processor.max_rows for p in pieces)

    model = load(ckpt, "cpu", "float32")
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    run = dataclasses.replace(
        open_stream(runner, 0, len(ids)).rows(ids, logits="all"),
        embeds=list(zip((p.start for p in pieces), model.encode_media(pieces))),
        blocks=[(p.start, p.end) for p in pieces],
    )
    (got,) = runner.run([run])

    ref = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    patches = max(i.positions.shape[0] for i, _ in images)
    pixels = torch.zeros(len(images), patches, 3 * 16 * 16)
    positions = torch.full((len(images), patches, 2), -1, dtype=torch.long)
    for i, (image, _) in enumerate(images):
        n = image.positions.shape[0]
        pixels[i, :n], positions[i, :n] = image.pixel_values, image.positions
    x = torch.tensor([ids])
    with torch.no_grad():
        want = ref(
            input_ids=x,
            pixel_values=pixels,
            image_position_ids=positions,
            mm_token_type_ids=(x == processor.placeholder_id).long(),
        ).logits[0]
    assert rel_err(got, want) <= 1e-4


def test_the_plan_counts_the_tower_at_the_largest_image(folder: Path) -> None:
    """The shape's media bytes: the tower's activations at 1120 soft tokens (9 patches each);
    none without a tower."""
    config = Checkpoint.open(folder).config
    vision = vision_config(config)
    assert vision is not None and vision.largest_image_patches == 1120 * 9
    got = shape(config, "bfloat16").media_bytes
    assert got == vision.activation_bytes(1120 * 9, 2) > vision.activation_bytes(630, 2) > 0
    assert shape({**config, "vision_config": None}, "bfloat16").media_bytes == 0


def test_a_dummy_model_encodes_images(folder: Path) -> None:
    """TF_LOAD_FORMAT=dummy on a config with a vision_config: a random tower beside the text
    model, whose rows fit what the folder-less hook prepares."""
    config = Checkpoint.open(folder).config
    model = load_dummy(config, "cpu", "float32")
    processor = media_processor(None, config)
    assert processor is not None
    inputs, rows = processor.prepare_image(_image(30, 20))
    (out,) = model.encode_media([MediaPiece(5, rows, 1, inputs, block=True)])
    assert out.shape == (rows, config["text_config"]["hidden_size"])
    assert torch.isfinite(out).all()
