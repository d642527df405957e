"""Gemma 4's audio features as Gemma4AudioFeatureExtractor (transformers 5.23.0) computes them:
16 kHz mono samples -> log-mel frames [T, mel] fp32, and the audio soft tokens Gemma4Processor
writes for them. numpy only.

Frames are semicausal: frame_length // 2 zeros go before the clip, then windows of
frame_length + 1 samples every hop_length (the last sample only feeds HTK preemphasis), a
periodic Hann window, an rfft of the next power of two, |.|, an HTK mel bank without
normalisation, log(mel + mel_floor), then per-bin mean and stddev if given. The reference pads
a batch to a multiple of 128 samples and zeroes (masks) every frame whose window reaches past
the clip's real samples; the frames kept here are exactly its valid ones, computed from the
clip alone: ((N + frame_length // 2 - (frame_length + 1)) // hop_length + 1 of N samples).
Settings come from processor_config.json's `feature_extractor` (class defaults otherwise).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .config import ConfigError

AUDIO_RATE = 16_000  # the only rate Gemma 4's feature extractor takes samples at


@dataclass(frozen=True)
class AudioSettings:
    """Gemma4AudioFeatureExtractor's settings, and the processor's cap on soft tokens."""

    feature_size: int = 128
    sampling_rate: int = AUDIO_RATE
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = False
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    audio_seq_length: int = 750  # the most soft tokens a clip may fill (Gemma4Processor)

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * n if self.fft_overdrive else n

    @property
    def max_samples(self) -> int:
        """The most samples a clip may have: its frames (frame_count) at most 4 x
        audio_seq_length, which two stride-2 convs bring to audio_seq_length soft tokens."""
        return 4 * self.audio_seq_length * self.hop_length + self.frame_length // 2

    @classmethod
    def from_dict(
        cls, raw: Mapping[str, Any], source: str, audio_seq_length: int | None = None
    ) -> "AudioSettings":
        """From a feature extractor's settings; refuses dither (random noise, never the same
        features twice) and a rate other than AUDIO_RATE."""
        if float(raw.get("dither") or 0.0) != 0.0:
            raise ConfigError(f"{source}: dither {raw['dither']} adds noise; only 0 is served")
        if int(raw.get("sampling_rate", AUDIO_RATE)) != AUDIO_RATE:
            raise ConfigError(f"{source}: sampling_rate {raw['sampling_rate']}, not {AUDIO_RATE}")
        names = {f for f in cls.__dataclass_fields__} - {"audio_seq_length"}
        values: dict[str, Any] = {k: raw[k] for k in names if raw.get(k) is not None}
        for k in ("per_bin_mean", "per_bin_stddev"):
            if k in values:  # the reference saves them shaped [1, 1, mel]
                values[k] = tuple(float(x) for x in np.asarray(values[k], float).reshape(-1))
        if audio_seq_length is not None:
            values["audio_seq_length"] = int(audio_seq_length)
        s = cls(**values)
        for k in ("per_bin_mean", "per_bin_stddev"):
            v = getattr(s, k)
            if v is not None and len(v) != s.feature_size:
                raise ConfigError(f"{source}: {k} has {len(v)} values, not {s.feature_size}")
        return s

    @classmethod
    def from_folder(cls, folder: Path) -> "AudioSettings":
        """From processor_config.json's `feature_extractor` (and its `audio_seq_length`);
        the class defaults where the folder has none."""
        path = folder / "processor_config.json"
        if not path.is_file():
            return cls()
        raw = json.loads(path.read_text())
        fe = raw.get("feature_extractor") or {}
        return cls.from_dict(fe, f"{path} feature_extractor", raw.get("audio_seq_length"))


def hann_window(length: int) -> np.ndarray:
    """The periodic Hann window (audio_utils.window_function), float32."""
    return np.hanning(length + 1)[:-1].astype(np.float32)


def mel_bank(s: AudioSettings) -> np.ndarray:
    """HTK triangular mel filters over the rfft bins, unnormalised: [fft/2 + 1, mel] float64."""
    bins = s.fft_length // 2 + 1

    def to_mel(hz: Any) -> Any:
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    mels = np.linspace(to_mel(s.min_frequency), to_mel(s.max_frequency), s.feature_size + 2)
    centers = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    fft_freqs = np.linspace(0, s.sampling_rate // 2, bins)
    diff = np.diff(centers)
    slopes = centers[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    return np.maximum(np.zeros(1), np.minimum(down, up))


def frame_count(samples: int, s: AudioSettings) -> int:
    """The valid feature frames of a clip of `samples` samples (0 if shorter than a window)."""
    return max((samples + s.frame_length // 2 - (s.frame_length + 1)) // s.hop_length + 1, 0)


def audio_soft_tokens(frames: int) -> int:
    """The rows a clip of `frames` feature frames fills: the audio tower's two stride-2 convs
    (padding 1, kernel 3) each give ceil(n / 2) of n."""
    return -(-(-(-frames // 2)) // 2)


def log_mel(samples: np.ndarray, s: AudioSettings) -> np.ndarray:
    """A clip's valid log-mel frames: samples [N] float (16 kHz mono) -> [frames, mel] fp32."""
    n = frame_count(len(samples), s)
    wave = np.asarray(samples, dtype=np.float32)[None]
    if s.input_scale_factor != 1.0:
        wave = wave * s.input_scale_factor
    wave = np.pad(wave, ((0, 0), (s.frame_length // 2, 0)))
    size = s.frame_length + 1
    if n == 0:
        return np.zeros((0, s.feature_size), np.float32)
    strides = (wave.strides[0], wave.strides[1] * s.hop_length, wave.strides[1])
    windows = np.lib.stride_tricks.as_strided(wave, (1, n, size), strides)
    if s.preemphasis > 0.0:
        p = s.preemphasis
        if s.preemphasis_htk_flavor:
            first = windows[..., :1] * (1.0 - p)
            frames = np.concatenate([first, windows[..., 1:-1] - p * windows[..., :-2]], axis=-1)
        else:
            frames = windows[..., 1:] - p * windows[..., :-1]
    else:
        frames = windows[..., :-1]
    spectrum = np.abs(np.fft.rfft(frames * hann_window(s.frame_length), n=s.fft_length, axis=-1))
    out = np.log(np.matmul(spectrum, mel_bank(s)) + np.array(s.mel_floor, dtype=np.float64))
    if s.per_bin_mean is not None:
        out = out - np.array(s.per_bin_mean).reshape(1, 1, -1)
    if s.per_bin_stddev is not None:
        out = out / np.array(s.per_bin_stddev).reshape(1, 1, -1)
    return out[0].astype(np.float32)
