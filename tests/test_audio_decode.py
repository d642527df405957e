"""core/server/audio_decode.py: WAV through `wave` (PCM 8/16/24/32-bit, stereo mixed down), mp3
through soundfile, the length limit read from the header, and refusals naming the problem (a
format not taken, not a WAV or not an mp3, float WAV)."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest

from tensorfold.family.media import MediaRefused
from tensorfold.server.audio_decode import decode_audio, pcm_samples


def wav_bytes(frames: np.ndarray, width: int, rate: int = 16_000) -> bytes:
    """A PCM WAV of integer frames [N, channels] at `width` bytes a sample."""
    if width == 1:
        raw = (frames + 128).astype(np.uint8).tobytes()
    elif width == 3:
        v = frames.astype(np.int32).reshape(-1)
        raw = np.stack([(v >> s) & 0xFF for s in (0, 8, 16)], -1).astype(np.uint8).tobytes()
    else:
        raw = frames.astype({2: "<i2", 4: "<i4"}[width]).tobytes()
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(frames.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return out.getvalue()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_pcm_widths_decode_to_their_values(width: int) -> None:
    full = 1 << (8 * width - 1)
    ints = np.array([[-full], [-full // 2], [0], [full // 4], [full - 1]])
    clip = decode_audio(wav_bytes(ints, width, 8000), "wav", "messages[0]", 10.0)
    assert clip.rate == 8000 and clip.samples.dtype == np.float32
    np.testing.assert_allclose(clip.samples, ints[:, 0] / full, atol=1e-6)


def test_stereo_is_averaged_to_mono() -> None:
    frames = np.array([[1000, -1000], [2000, 0], [-4000, -2000]])
    clip = decode_audio(wav_bytes(frames, 2), "wav", "x", 10.0)
    np.testing.assert_allclose(clip.samples, np.array([0, 1000, -3000]) / 32768.0, atol=1e-7)
    assert clip.seconds == 3 / 16_000


def test_refusals_name_the_problem() -> None:
    long = wav_bytes(np.zeros((16_001, 1)), 2)
    with pytest.raises(MediaRefused, match=r"1\.00 s; the limit is 1 s"):
        decode_audio(long, "wav", "messages[1]", 1.0)
    with pytest.raises(MediaRefused, match="does not decode as mp3"):
        decode_audio(b"ID3...", "mp3", "messages[0]", 10.0)
    with pytest.raises(MediaRefused, match="'ogg' is not taken; send WAV"):
        decode_audio(b"OggS", "ogg", "messages[0]", 10.0)
    with pytest.raises(MediaRefused, match="the bytes are WAV, not mp3"):
        decode_audio(wav_bytes(np.zeros((100, 1)), 2), "mp3", "messages[0]", 10.0)
    with pytest.raises(MediaRefused, match="messages\\[0\\]: the audio does not decode as WAV"):
        decode_audio(b"not a wav at all", "wav", "messages[0]", 10.0)
    fmt = struct.pack("<HHIIHH", 3, 1, 16_000, 64_000, 4, 32)  # IEEE float: not PCM
    data = np.zeros(4, "<f4").tobytes()
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", 16) + data
    float_wav = b"RIFF" + struct.pack("<I", len(body)) + body
    with pytest.raises(MediaRefused, match="does not decode as WAV"):
        decode_audio(float_wav, "wav", "messages[0]", 10.0)
    with pytest.raises(MediaRefused, match="40 bits"):
        pcm_samples(b"\0" * 10, 5)


def mp3_bytes(samples: np.ndarray, rate: int = 16_000) -> bytes:
    import soundfile

    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="MP3")
    return out.getvalue()


def test_mp3_decodes_to_its_tone_and_its_length_is_judged_first() -> None:
    t = np.arange(16_000) / 16_000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    stereo = np.stack([tone, tone], axis=1)
    clip = decode_audio(mp3_bytes(stereo), "mp3", "messages[0]", 10.0)
    assert clip.rate == 16_000 and abs(clip.seconds - 1.0) < 0.1
    spectrum = np.abs(np.fft.rfft(clip.samples))
    peak_hz = np.argmax(spectrum) * clip.rate / len(clip.samples)
    assert abs(peak_hz - 440) < 5 and 0.3 < np.abs(clip.samples).max() < 0.7
    with pytest.raises(MediaRefused, match="the limit is 0.5 s"):
        decode_audio(mp3_bytes(tone), "mp3", "messages[0]", 0.5)
