"""glm5_next's media_processor hook (media_processor.py): what a checkpoint's images become in a
prompt. The demo's template places `{"type": "image"}` parts as GLM-4.xV's templates do, its
tokenizer reads the placeholder as config.json's image_token_id, and each placeholder becomes
as many image tokens as transformers' `Glm5NextProcessor.replace_image_token` writes; settings
come from preprocessor_config.json or processor_config.json and must fit the tower; a text-only
checkpoint answers None. The vision demo helper writes a checkpoint the family loads whole."""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaProcessor, MediaRefused, expand_media, media_key
from tensorfold.family.plugins import family_plugin_manager
from tensorfold.family.tokenizer import Tokenizer
from tensorfold_glm import GLM5_NEXT, demo
from tensorfold_glm.image_processing import ImageProcessor
from tensorfold_glm.media_processor import GlmImage, GlmMediaProcessor, media_processor
from tensorfold_glm.vision_demo import SAMPLE, write_vision_demo

Image = pytest.importorskip("PIL.Image")

VISION = {"patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2}


@pytest.fixture(scope="module")
def vision_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vision_demo(tmp_path_factory.mktemp("vision_demo") / "ckpt")


def hook(folder: Path | None, config: dict[str, Any]) -> Any:
    return family_plugin_manager(GLM5_NEXT, []).hook.media_processor(folder=folder, config=config)


def test_the_demo_places_images_as_the_processor_expands_them(vision_demo: Path) -> None:
    ckpt = Checkpoint.open(vision_demo)
    processor = hook(vision_demo, ckpt.config)
    assert isinstance(processor, GlmMediaProcessor) and isinstance(processor, MediaProcessor)
    assert (processor.kinds, processor.block, processor.max_rows) == ({"image"}, False, 1024)
    tok = Tokenizer.from_checkpoint(ckpt)
    assert processor.placeholder == "<|image|>"
    assert tok.token_to_id(processor.placeholder) == processor.placeholder_id
    assert processor.placeholder_id == ckpt.config["image_token_id"]
    chat = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "image"}],
        }
    ]
    text = render_chat(tok.chat_template or "", chat).text
    assert "Look:" + "<|begin_of_image|><|image|><|end_of_image|>" * 2 in text
    ids = tok.encode(text)
    images = []
    for i, size in enumerate([(96, 64), (300, 120)]):
        inputs, rows = processor.prepare_image(Image.new("RGB", size, (40 * i, 90, 200)))
        images.append((inputs, rows, media_key(i)))
    out, pieces = expand_media(ids, processor, images)
    begin, end = tok.token_to_id("<|begin_of_image|>"), tok.token_to_id("<|end_of_image|>")
    for piece, (inputs, rows, _) in zip(pieces, images):
        assert isinstance(inputs, GlmImage) and piece.rows == rows
        assert out[piece.start - 1] == begin and out[piece.end] == end
        assert out[piece.start : piece.end] == [processor.placeholder_id] * rows
        # transformers' Glm5NextProcessor writes grid.prod() // merge² image tokens
        from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

        stub = SimpleNamespace(
            image_token="<|image|>", image_processor=SimpleNamespace(merge_size=2)
        )
        grid = torch.tensor([inputs.grid_thw])
        written = Glm5NextProcessor.replace_image_token(stub, {"image_grid_thw": grid}, 0)
        assert written == "<|image|>" * rows
    assert len(out) == len(ids) - 2 + sum(p.rows for p in pieces)


def test_prepared_pixels_are_the_image_processors(vision_demo: Path) -> None:
    processor = hook(vision_demo, Checkpoint.open(vision_demo).config)
    image = Image.open(io.BytesIO((vision_demo / SAMPLE).read_bytes()))
    inputs, rows = processor.prepare_image(image)
    want = ImageProcessor.from_folder(vision_demo)([image])
    assert torch.equal(inputs.pixel_values, want.pixel_values)
    assert [list(inputs.grid_thw)] == want.grid_thw.tolist() and [rows] == want.token_counts
    # prepared in a prompt worker, they cross to the engine's process pickled
    back = pickle.loads(pickle.dumps(inputs))
    assert torch.equal(back.pixel_values, inputs.pixel_values) and back.grid_thw == inputs.grid_thw
    assert pickle.loads(pickle.dumps(processor)).prepare_image(image)[1] == rows


def test_an_image_past_the_planned_rows_is_refused(
    vision_demo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorfold_glm import media_processor as module

    processor = hook(vision_demo, Checkpoint.open(vision_demo).config)
    image = Image.open(io.BytesIO((vision_demo / SAMPLE).read_bytes()))
    rows = processor.prepare_image(image)[1]
    monkeypatch.setattr(module, "DEFAULT_MAX_ROWS", rows - 1)  # the plan's tower rows
    with pytest.raises(MediaRefused, match=f"fills {rows} rows .* past the {rows - 1} rows"):
        processor.prepare_image(image)


def test_settings_sources_and_refusals(tmp_path: Path) -> None:
    config = {"vision_config": dict(VISION), "image_token_id": 7}
    assert hook(tmp_path, {"image_token_id": 7}) is None  # no vision_config: text alone
    assert media_processor(None, config).settings == {
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"image_processor": {"max_image_tokens": 33}, "video_processor": {}})
    )
    assert media_processor(tmp_path, config).max_rows == 33
    (tmp_path / "preprocessor_config.json").write_text('{"max_image_tokens": 44}')
    assert media_processor(tmp_path, config).max_rows == 44  # preprocessor_config.json first
    (tmp_path / "preprocessor_config.json").write_text('{"patch_size": 16}')
    with pytest.raises(ValueError, match="patch_size 16 is not the vision tower's patch_size 14"):
        media_processor(tmp_path, config)
    with pytest.raises(ValueError, match="no image_token_id"):
        media_processor(None, {"vision_config": {}})


def test_the_vision_demo_loads_with_its_tower(vision_demo: Path) -> None:
    from tensorfold_glm.model import load

    assert sorted(p.name for p in vision_demo.iterdir()) == sorted([*demo.FILES, SAMPLE])
    model = load(Checkpoint.open(vision_demo), "cpu", "float32")
    assert model.vision is not None and model.vision.cfg.out_hidden_size == model.cfg.hidden_size
    with pytest.raises(FileExistsError):
        write_vision_demo(vision_demo)


def test_the_mtp_layer_embeds_the_image_rows(vision_demo: Path) -> None:
    """The MTP's rows at an image read the tower's rows, as the trunk's do (mtp.py): with the
    trunk's hidden states alike, its logits before the image are the same bits with or without
    them, and at the image differ."""
    from tensorfold.engine.runner import ModelRunner, open_stream
    from tensorfold.family.forward_pass import ForwardPass
    from tensorfold_glm import config
    from tensorfold_glm.model import load
    from tensorfold_glm.mtp import mtp_forward

    was = config.serve_mtp(True)
    try:
        model = load(Checkpoint.open(vision_demo), "cpu", "float32")
    finally:
        config.serve_mtp(was)
    assert model.weights.mtp is not None
    processor = hook(vision_demo, Checkpoint.open(vision_demo).config)
    tok = Tokenizer.from_checkpoint(Checkpoint.open(vision_demo))
    text = render_chat(tok.chat_template or "", [{"role": "user", "content": [{"type": "image"}]}])
    inputs, rows = processor.prepare_image(Image.new("RGB", (96, 64), (10, 200, 30)))
    ids, (piece,) = expand_media(tok.encode(text.text), processor, [(inputs, rows, 1)])
    (image,) = model.encode_media([piece])

    def mtp_logits(images: bool) -> torch.Tensor:
        runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
        run = open_stream(runner, 0, len(ids)).rows(ids, logits="all")
        run = dataclasses.replace(run, embeds=[(piece.start, image)])
        fp = ForwardPass([run], 512, model.device)
        hidden = torch.empty(fp.num_rows, model.cfg.hidden_size)
        model.forward(fp, runner.rows, runner.slots, hidden=hidden)
        own = run if images else dataclasses.replace(run, embeds=())
        return mtp_forward(model, ForwardPass([own], 512), runner.rows, runner.slots, hidden)[0]

    with torch.no_grad():
        seen, unseen = mtp_logits(True), mtp_logits(False)
    assert torch.equal(seen[: piece.start], unseen[: piece.start])
    assert not torch.allclose(seen[piece.start : piece.end], unseen[piece.start : piece.end])


def test_building_the_processor_loads_no_torch(vision_demo: Path) -> None:
    """Prompt workers build it once each: json only, torch and Pillow with the first image."""
    code = (
        "import sys; from pathlib import Path; from tensorfold_glm.media_processor import "
        "media_processor as m; import json; f = Path(sys.argv[1]); "
        "p = m(f, json.loads((f / 'config.json').read_text())); "
        "assert p.image_ids(2) == ([p.placeholder_id] * 2, 0) and p.max_rows == 1024; "
        "assert 'torch' not in sys.modules and 'PIL' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code, str(vision_demo)], check=True, timeout=120)
