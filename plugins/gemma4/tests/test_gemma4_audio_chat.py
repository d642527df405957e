"""gemma4 audio chats end to end, on the vision demo checkpoint with its random audio tower
(`write_vision_demo(audio=True)`), fp32 on the CPU: an input_audio part's WAV through
`tensorfold.LLM.chat` gives the same tokens alone and beside a text chat, the census even;
through the server, a clip's rows counted in usage, "audio" in /v1/models, and every bad clip a
400 naming the problem (bad mp3, a rate other than 16 kHz, too many, too long, not base64); a prompt
with two clips and an image matches transformers' logits; the memory plan and a dummy load
count the audio tower; a resumed audio chat is the fresh one, and another clip never resumes
past its own rows."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from PIL import Image

from tensorfold import testing
from tensorfold.config.settings import Settings
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.engine.sampling import SamplingParams
from tensorfold.engine.start import Served, open_served
from tensorfold.family.chat_template import render_chat
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.media import MediaPiece, expand_media
from tensorfold.family.tokenizer import Tokenizer
from tensorfold.server.app import create_app
from tensorfold.server.media_limits import MediaLimits
from tensorfold.server.request_limits import Limits
from tensorfold.testing import rel_err
from tensorfold_gemma4.audio_config import audio_config
from tensorfold_gemma4.dummy import load_dummy
from tensorfold_gemma4.media import media_processor
from tensorfold_gemma4.model import load, shape
from tensorfold_gemma4.vision_config import vision_config
from tensorfold_gemma4.vision_demo import write_vision_demo

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"


def wav(seconds: float, rate: int = 16_000, channels: int = 1, seed: int = 0) -> bytes:
    """A 16-bit PCM WAV of a tone with noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate)
    t = np.arange(n) / rate
    x = 0.4 * np.sin(2 * np.pi * 330 * t) + 0.05 * rng.standard_normal(n)
    frames = np.repeat((x * 32767).astype("<i2")[:, None], channels, axis=1)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(frames.tobytes())
    return out.getvalue()


def audio_part(blob: bytes, fmt: str = "wav") -> dict[str, Any]:
    data = base64.b64encode(blob).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def conversation(*parts: dict[str, Any], text: str = "What do you hear?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:

    return write_vision_demo(tmp_path_factory.mktemp("gemma4_audio_chat") / "ckpt", audio=True)


def test_an_audio_chat_is_the_same_alone_and_beside_text(folder: Path) -> None:
    audio_chat = conversation(audio_part(wav(0.5)), audio_part(wav(0.3, channels=2, seed=1)))
    text_chat = conversation(text="Tell me about the sea.")
    llm = testing.open_llm("gemma4", folder, context=1024)
    try:
        (alone,) = llm.chat([audio_chat], GREEDY)
        together = llm.chat([text_chat, audio_chat], GREEDY)
        (quiet,) = llm.chat([conversation(audio_part(wav(0.5, seed=5)), audio_part(wav(0.3)))])
    finally:
        testing.close_even(llm)
    assert len(alone.token_ids) == 6
    assert together[1].token_ids == alone.token_ids
    assert quiet is not None  # another clip runs too (the tower is untrained: no claim on text)


@pytest.fixture(scope="module")
def served(folder: Path) -> Iterator[Served]:
    s = open_served(Settings(memory_limit_gib=1, context=1024, parallel=2), "gemma4", folder)
    yield s
    s.close()


def post(served: Served, *bodies: dict[str, Any], path: str = CHAT) -> list[tuple[int, Any]]:
    limits = Limits(
        media=MediaLimits(max_clips=2, max_audio_bytes=64 * 1024, max_audio_seconds=1.5)
    )
    app = create_app(served, limits=limits, access_log=False)

    async def go() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for body in bodies:
                if path in (CHAT, RESPONSES):
                    resp = await client.post(path, json=body)
                else:
                    resp = await client.get(path)
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(go())


def body(*parts: dict[str, Any]) -> dict[str, Any]:
    return {"messages": conversation(*parts), "max_tokens": 2}


def mp3(seconds: float) -> bytes:
    import soundfile

    t = np.arange(int(seconds * 16_000)) / 16_000
    out = io.BytesIO()
    soundfile.write(out, 0.4 * np.sin(2 * np.pi * 330 * t), 16_000, format="MP3")
    return out.getvalue()


def test_the_server_takes_a_clip_and_counts_its_rows(served: Served) -> None:
    [(status, reply), (mp3_status, mp3_reply)] = post(
        served, body(audio_part(wav(0.5))), body(audio_part(mp3(0.5), "mp3"))
    )
    assert status == 200, reply
    assert mp3_status == 200, mp3_reply
    [(plain_status, plain)] = post(served, body())
    assert plain_status == 200
    rows = 13  # 0.5 s: 49 frames, 13 audio tokens; begin- and end-of-audio replace the token
    assert reply["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + rows + 2
    [(_, models)] = post(served, {}, path="/v1/models")
    assert models["data"][0]["input_modalities"] == ["text", "audio", "image"]


def test_the_responses_api_takes_the_same_clip(served: Served) -> None:
    content = [audio_part(wav(0.5)), {"type": "input_text", "text": "What do you hear?"}]
    responses = {"input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    [(status, reply)] = post(served, responses, path=RESPONSES)
    [(chat_status, chat)] = post(served, body(audio_part(wav(0.5))))
    assert status == 200 and chat_status == 200, (reply, chat)
    assert reply["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
    content[0] = {"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}}
    [(status, reply)] = post(served, responses, path=RESPONSES)
    assert status == 400 and "wav, mp3" in reply["error"]["message"], reply


@pytest.mark.parametrize(
    ("parts", "names"),
    [
        ((audio_part(b"ID3", "mp3"),), "does not decode as mp3"),
        ((audio_part(wav(0.5, rate=44_100)),), "resample it to 16000 Hz"),
        ((audio_part(wav(0.2)),) * 3, "TF_MAX_AUDIO_CLIPS"),
        ((audio_part(wav(2.0)),), "TF_MAX_AUDIO_SECONDS"),
        ((audio_part(wav(2.5, rate=16_000, channels=2)),), "TF_MAX_AUDIO_MIB"),
        (({"type": "input_audio", "input_audio": {"data": "not base64!"}},), "not base64"),
        (({"type": "input_audio", "input_audio": {"data": "", "format": "ogg"}},), "wav, mp3"),
        ((audio_part(b"RIFF....WAVEjunk"),), "does not decode as WAV"),
    ],
    ids=["mp3", "rate", "too_many", "too_long", "too_big", "base64", "format", "not_wav"],
)
def test_bad_clips_are_400s_naming_the_problem(served: Served, parts: Any, names: str) -> None:
    [(status, reply), (after, _)] = post(served, body(*parts), body(audio_part(wav(0.4))))
    assert status == 400, reply
    assert names in reply["error"]["message"], reply
    assert after == 200  # the next request is served as before


def test_the_plan_counts_the_audio_tower_at_the_longest_clip(folder: Path) -> None:
    """The shape's media bytes: the larger of the vision tower's at the largest image and the
    audio tower's at 30 s (3000 frames of 128 bins); the audio bound grows with the clip."""

    config = Checkpoint.open(folder).config
    audio, vision = audio_config(config), vision_config(config)
    assert audio is not None and vision is not None
    clip = audio.activation_bytes(3000, 128, 4)
    assert clip > audio.activation_bytes(300, 128, 4) > 0
    image = vision.activation_bytes(vision.largest_image_patches, 4)
    assert shape(config, "float32").media_bytes == max(clip, image)
    only_audio = {**config, "vision_config": None}
    assert shape(only_audio, "float32").media_bytes == clip


def test_a_dummy_model_encodes_clips(folder: Path) -> None:
    """TF_LOAD_FORMAT=dummy on a config with an audio_config: a random audio tower beside the
    text model, whose rows fit what the folder-less hook prepares."""

    config = Checkpoint.open(folder).config
    model = load_dummy(config, "cpu", "float32")
    processor = media_processor(None, config)
    assert processor is not None and "audio" in processor.kinds
    samples = np.random.default_rng(2).standard_normal(8000).astype(np.float32) * 0.3
    inputs, rows = processor.prepare_audio(samples, 16_000)
    (out,) = model.encode_media([MediaPiece(5, rows, 1, inputs, kind="audio")])
    assert out.shape == (rows, config["text_config"]["hidden_size"]) and rows == 13
    assert torch.isfinite(out).all() and out.std() > 0


def test_an_audio_and_image_prompt_matches_the_reference(folder: Path) -> None:
    """The demo's chat template, tokenizer and processor place a clip and an image as
    Gemma4Processor would; every prompt row's logits equal Gemma4ForConditionalGeneration's
    (loaded from the same folder) fed the reference extractor's features, fp32, <= 1e-4."""
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    ckpt = Checkpoint.open(folder)
    processor = media_processor(folder, ckpt.config)
    assert processor is not None and processor.kinds == {"image", "audio"}
    tok = Tokenizer.from_checkpoint(ckpt)
    assert tok.chat_template is not None
    content = [
        {"type": "audio"},
        {"type": "text", "text": "and"},
        {"type": "image"},
        {"type": "audio"},
    ]
    text = render_chat(
        tok.chat_template, [{"role": "user", "content": content}], bos_token="<bos>"
    ).text
    assert text.count("<|audio|>") == 2
    rng = np.random.default_rng(9)
    clips = [(0.3 * rng.standard_normal(n)).astype(np.float32) for n in (8000, 4800)]
    heard = [processor.prepare_audio(c, 16_000) for c in clips]
    image = Image.new("RGB", (64, 48), (200, 40, 40))
    seen = processor.prepare_image(image)
    ids, pieces = expand_media(
        tok.encode(text),
        processor,
        [(seen[0], seen[1], 1)],
        [(inputs, rows, 2 + i) for i, (inputs, rows) in enumerate(heard)],
    )
    assert [p.kind for p in pieces] == ["audio", "image", "audio"]

    model = load(ckpt, "cpu", "float32")
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    run = dataclasses.replace(
        open_stream(runner, 0, len(ids)).rows(ids, logits="all"),
        embeds=list(zip((p.start for p in pieces), model.encode_media(pieces))),
        blocks=[(p.start, p.end) for p in pieces if p.block],
    )
    (got,) = runner.run([run])

    ref = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    feats = Gemma4AudioFeatureExtractor()(clips, return_tensors="pt")
    x = torch.tensor([ids])
    kinds = (x == processor.placeholder_id).long() + 3 * (x == processor.audio_placeholder_id)
    with torch.no_grad():
        want = ref(
            input_ids=x,
            pixel_values=seen[0].pixel_values[None],
            image_position_ids=seen[0].positions[None],
            input_features=feats["input_features"],
            input_features_mask=feats["input_features_mask"],
            mm_token_type_ids=kinds.long(),
        ).logits[0]
    assert rel_err(got, want) <= 1e-4


def test_a_resumed_audio_chat_is_the_fresh_one_and_another_clip_never_resumes(
    folder: Path,
) -> None:
    """A chat's second turn with a clip in its first: resumed from the prompt store it gives
    the fresh engine's tokens, with the clip's rows among those resumed; the same words about
    another clip resume at most the rows before the clip."""
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
    question = "What is said in the recording? " * 12
    clip, other = wav(1.0), wav(1.0, seed=4)
    kept_rows = 64  # past the clip's 25 rows and their bounds

    def second_turn(llm: Any) -> tuple[list[int], int]:
        chat = conversation(audio_part(clip), text=question)
        reply = llm.chat([chat], sampled)[0]
        turn = chat + [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "More?"},
        ]
        done = llm.chat([turn], sampled)[0]
        return done.token_ids, done.cached_tokens

    fresh = testing.open_llm("gemma4", folder, context=1024)
    try:
        want, cached = second_turn(fresh)
        assert cached == 0
    finally:
        testing.close_even(fresh)
    kept = testing.open_llm("gemma4", folder, context=1024, kv_share=16, prompt_cache_gib=0.05)
    try:
        got, cached = second_turn(kept)
        assert got == want and cached >= kept_rows, (cached, kept_rows)
        again = kept.chat([conversation(audio_part(other), text=question)], sampled)[0]
        assert again.cached_tokens < 16, "another clip resumed as the first"
    finally:
        testing.close_even(kept)
