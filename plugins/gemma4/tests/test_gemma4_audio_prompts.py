"""gemma4 answers audio prompts: the media processor's audio side (prepare_audio, audio_ids,
refusals) and every prompt row's logits through the runner (the audio tower's rows over the
placeholders) against transformers 5.23.0's Gemma4ForConditionalGeneration fed the reference
feature extractor's features, with 1 and 2 clips of different lengths, fp32, <= 1e-4 relative.
The text config has `use_bidirectional_attention: "vision"`: audio rows stay causal, as the
reference's blocks hold image and video tokens only. A clip's frames reversed come
out otherwise (the parity test can fail)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gemma4_media_configs import MEDIA_IDS, TINY_TEXT

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.media import AudioProcessor, MediaPiece, MediaRefused, expand_media
from tensorfold.testing import rel_err
from tensorfold_gemma4.media import GemmaClip, media_processor
from tensorfold_gemma4.model import Gemma4Model, load

IDS = MEDIA_IDS
SAMPLES = (6400, 3200)  # 0.4 s and 0.2 s at 16 kHz: 10 and 5 audio tokens


def _reference(folder: Path) -> Any:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(
        TINY_TEXT,
        intermediate_size=96,
        hidden_size_per_layer_input=16,
        use_bidirectional_attention="vision",
        initializer_range=0.1,
    )
    audio = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 2],  # 128 mel bins, the feature extractor's default
        output_proj_dims=24,
        attention_chunk_size=4,
        attention_context_left=5,
    )
    torch.manual_seed(8)
    ref = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=text, vision_config=None, audio_config=audio, **IDS)
    ).eval()
    ref.save_pretrained(folder)
    return ref


def _clips() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [(0.3 * rng.standard_normal(n)).astype(np.float32) for n in SAMPLES]


def _prompt(config: dict[str, Any], count: int, order: list[int] | None = None) -> Any:
    gen = torch.Generator().manual_seed(14)
    ids = [2]
    for _ in range(count):
        ids += torch.randint(3, 249, (7,), generator=gen).tolist() + [IDS["audio_token_id"]]
    ids += torch.randint(3, 249, (4,), generator=gen).tolist()
    processor = media_processor(None, config)
    assert processor is not None and isinstance(processor, AudioProcessor)
    clips = [processor.prepare_audio(c, 16_000) for c in _clips()[:count]]
    audio = [(inputs, rows, 1 + i) for i, (inputs, rows) in enumerate(clips)]
    if order is not None:
        audio = [(audio[j][0], audio[i][1], audio[i][2]) for i, j in enumerate(order)]
    return expand_media(ids, processor, [], audio)


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Gemma4Model, dict]:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    from tensorfold.family.checkpoint import Checkpoint

    folder = tmp_path_factory.mktemp("gemma4_audio_prompts")
    ref = _reference(folder)
    ckpt = Checkpoint.open(folder)
    return ref, load(ckpt, "cpu", "float32"), ckpt.config


def _ref_logits(ref: Any, ids: list[int], count: int) -> torch.Tensor:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    feats = Gemma4AudioFeatureExtractor()(_clips()[:count], return_tensors="pt")
    x = torch.tensor([ids])
    with torch.no_grad():
        return ref(
            input_ids=x,
            input_features=feats["input_features"],
            input_features_mask=feats["input_features_mask"],
            mm_token_type_ids=(x == IDS["audio_token_id"]).long() * 3,
        ).logits[0]


def _ours(
    model: Gemma4Model, ids: list[int], pieces: list[MediaPiece], as_blocks: bool = False
) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    stream = open_stream(runner, 0, len(ids))
    embeds = list(zip((p.start for p in pieces), model.encode_media(pieces)))
    blocks = [(p.start, p.end) for p in pieces if p.block or as_blocks]
    run = dataclasses.replace(stream.rows(ids, logits="all"), embeds=embeds, blocks=blocks)
    (out,) = runner.run([run])
    stream.lease.release()
    return out


@pytest.mark.parametrize("count", [1, 2], ids=["one_clip", "two_clips"])
def test_audio_prompts_match_the_reference(case: Any, count: int) -> None:
    ref, model, config = case
    ids, pieces = _prompt(config, count)
    assert [(p.rows, p.kind, p.block) for p in pieces] == [
        (10, "audio", False),
        (5, "audio", False),
    ][:count]
    want = _ref_logits(ref, ids, count)
    got = _ours(model, ids, pieces)
    assert got.shape == want.shape
    assert rel_err(got, want) <= 1e-4


def test_a_clip_played_backwards_differs(case: Any) -> None:
    """The first clip's frames reversed (same rows, other sound): the logits from its first row
    on leave the reference's, the rows before it stay."""
    ref, model, config = case
    ids, pieces = _prompt(config, 2)
    reversed_clip = GemmaClip(pieces[0].inputs.features.flip(0))
    got = _ours(model, ids, [dataclasses.replace(pieces[0], inputs=reversed_clip), pieces[1]])
    want = _ref_logits(ref, ids, 2)
    start = pieces[0].start
    assert rel_err(got[:start], want[:start]) <= 1e-4
    assert rel_err(got[start:], want[start:]) > 1e-2


def test_audio_rows_as_a_block_differ(case: Any) -> None:
    """A clip's rows attending both ways in the sliding layers (as an image's do) leave the
    reference: its audio rows are causal, so pieces of kind "audio" are no block."""
    ref, model, config = case
    ids, pieces = _prompt(config, 1)
    assert rel_err(_ours(model, ids, pieces, as_blocks=True), _ref_logits(ref, ids, 1)) > 1e-2


def test_the_processor_s_audio_ids_and_refusals(case: Any) -> None:
    _, _, config = case
    processor = media_processor(None, config)
    assert processor is not None and processor.kinds == {"audio"}
    assert (processor.audio_placeholder, processor.audio_placeholder_id) == ("<|audio|>", 252)
    assert processor.audio_ids(2) == ([255, 252, 252, 249], 1)
    with pytest.raises(MediaRefused, match="16000 Hz"):
        processor.prepare_audio(np.zeros(4410, np.float32), 44_100)
    with pytest.raises(MediaRefused, match="too short"):
        processor.prepare_audio(np.zeros(100, np.float32), 16_000)
    with pytest.raises(MediaRefused, match="at most 30.01 s"):
        processor.prepare_audio(np.zeros(16_000 * 31, np.float32), 16_000)
    with pytest.raises(MediaRefused, match="no vision tower"):
        processor.prepare_image(None)


def test_a_vision_only_checkpoint_takes_no_audio(tmp_path: Path) -> None:
    config = {"text_config": {"hidden_size": 64}, "vision_config": {}}
    processor = media_processor(None, config)
    assert processor is not None and processor.kinds == {"image"}
    with pytest.raises(MediaRefused, match="no audio tower"):
        processor.audio_ids(1)
