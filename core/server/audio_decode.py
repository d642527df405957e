"""A request's audio from its input_audio parts to float samples: the parts' base64 data checked
against the count and byte limits and decoded where the request is read (`load_clips`), then,
where prompts are made, WAV through the standard library's `wave` (PCM of 8, 16, 24 or 32 bits,
mono, or several channels averaged to one), its length read from the header and refused past a
limit before a sample is decoded (`decode_audio`).

mp3 goes through soundfile (python-soundfile: its wheels bundle libsndfile 1.1+, which decodes
MPEG layer III with no system package), its length read from its header first likewise; a clip
soundfile cannot read is a 400 naming WAV. Samples stay at the file's rate; the family's
processor takes the rate it needs or refuses it.
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..family.media import MediaRefused
from .media_limits import MIB

if TYPE_CHECKING:
    from .image_parts import AudioRef
    from .media_limits import MediaLimits

ACCEPTED_AUDIO = "WAV (PCM 8, 16, 24 or 32-bit, mono or stereo) or mp3"


@dataclass(frozen=True)
class Clip:
    """One decoded clip: samples [N] float32 in [-1, 1], mono, at `rate` Hz."""

    samples: np.ndarray
    rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate


def load_clips(refs: Sequence[AudioRef], limits: MediaLimits) -> list[bytes]:
    """The clips' encoded bytes from their base64 data; MediaRefused for more clips than
    TF_MAX_AUDIO_CLIPS, a clip past TF_MAX_AUDIO_MIB (judged from its base64 length before it
    is decoded), or data that is not base64."""
    if len(refs) > limits.max_clips:
        raise MediaRefused(
            f"the request holds {len(refs)} audio clips; the limit is {limits.max_clips} a "
            "request (TF_MAX_AUDIO_CLIPS): send fewer"
        )
    out = []
    for ref in refs:
        size = len(ref.data) // 4 * 3
        if size > limits.max_audio_bytes + 2:  # base64 padding: up to 2 bytes fewer
            raise MediaRefused(
                f"{ref.where}: the clip is about {size} bytes; the limit is "
                f"{limits.max_audio_bytes} bytes ({limits.max_audio_bytes / MIB:g} MiB: "
                "TF_MAX_AUDIO_MIB)"
            )
        try:
            blob = base64.b64decode(ref.data, validate=True)
        except (binascii.Error, ValueError):
            raise MediaRefused(f"{ref.where}.input_audio.data is not base64") from None
        if len(blob) > limits.max_audio_bytes:
            raise MediaRefused(
                f"{ref.where}: the clip is {len(blob)} bytes; the limit is "
                f"{limits.max_audio_bytes} bytes (TF_MAX_AUDIO_MIB)"
            )
        out.append(blob)
    return out


def decode_audio(blob: bytes, fmt: str, where: str, max_seconds: float) -> Clip:
    """The clip in `blob` of format `fmt` ("wav" or "mp3"); MediaRefused for another format,
    bytes that are not a PCM WAV (an mp3), or a clip longer than max_seconds (read from the
    header first)."""
    if fmt == "mp3":
        return decode_mp3(blob, where, max_seconds)
    if fmt != "wav":
        raise MediaRefused(f"{where}: audio format {fmt!r} is not taken; send {ACCEPTED_AUDIO}")
    try:
        with wave.open(io.BytesIO(blob), "rb") as w:
            channels, width, rate, frames = (
                w.getnchannels(),
                w.getsampwidth(),
                w.getframerate(),
                w.getnframes(),
            )
            if channels <= 0:
                raise MediaRefused(f"{where}: the WAV header says {channels} channels")
            _check_length(frames, rate, where, max_seconds)
            raw = w.readframes(frames)
    except MediaRefused:
        raise
    except (wave.Error, EOFError, ValueError) as exc:  # not RIFF/WAVE, not PCM, truncated
        raise MediaRefused(
            f"{where}: the audio does not decode as {ACCEPTED_AUDIO}: {exc}"
        ) from None
    usable = len(raw) // (width * channels) * width * channels  # a truncated last frame dropped
    samples = pcm_samples(raw[:usable], width).reshape(-1, channels)
    return Clip(samples.mean(axis=1, dtype=np.float64).astype(np.float32), rate)


def decode_mp3(blob: bytes, where: str, max_seconds: float) -> Clip:
    """An mp3 clip through soundfile, channels averaged; its length from the header first."""
    import soundfile

    try:
        with soundfile.SoundFile(io.BytesIO(blob)) as f:
            if f.format != "MP3":
                raise MediaRefused(
                    f"{where}: the bytes are {f.format}, not mp3; send {ACCEPTED_AUDIO}"
                )
            _check_length(f.frames, f.samplerate, where, max_seconds)
            samples = f.read(dtype="float32", always_2d=True)
            rate = f.samplerate
    except MediaRefused:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError) as exc:
        raise MediaRefused(f"{where}: the audio does not decode as mp3: {exc}") from None
    return Clip(samples.mean(axis=1, dtype=np.float64).astype(np.float32), rate)


def _check_length(frames: int, rate: int, where: str, max_seconds: float) -> None:
    if rate <= 0:
        raise MediaRefused(f"{where}: the audio header says {rate} Hz")
    if frames / rate > max_seconds:
        raise MediaRefused(
            f"{where}: the clip is {frames / rate:.2f} s; the limit is {max_seconds:g} s "
            "(TF_MAX_AUDIO_SECONDS)"
        )


def pcm_samples(raw: bytes, width: int) -> np.ndarray:
    """Little-endian PCM of `width` bytes a sample as floats in [-1, 1]: 8-bit unsigned, 16,
    24 and 32-bit signed. [N] float32."""
    if width == 1:
        return (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    if width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        return v.astype(np.float32) / float(1 << 23)
    if width == 4:
        return (np.frombuffer(raw, "<i4").astype(np.float64) / float(1 << 31)).astype(np.float32)
    raise MediaRefused(f"PCM of {8 * width} bits a sample is not taken; send {ACCEPTED_AUDIO}")
