"""gemma4's audio features (audio_features.py) against transformers 5.23.0's
Gemma4AudioFeatureExtractor and Gemma4Processor's audio soft-token count: clips of several
lengths, default and preemphasised settings, the valid frames bit-equal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensorfold_gemma4.audio_features import AudioSettings, audio_soft_tokens, frame_count, log_mel
from tensorfold_gemma4.config import ConfigError

LENGTHS = (321, 1600, 4001, 8123)  # samples: one frame, whole hops, odd tails


def _clip(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16_000
    return (0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize(
    "settings",
    [{}, {"preemphasis": 0.97, "feature_size": 64, "per_bin_mean": [0.1] * 64}],
    ids=["defaults", "preemphasis"],
)
def test_features_match_the_reference(settings: dict) -> None:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    ref = Gemma4AudioFeatureExtractor(**settings)
    ours = AudioSettings.from_dict(settings, "test")
    # what the reference saves (processor_config.json's feature_extractor) reads back the same
    saved = json.loads(ref.to_json_string())
    assert AudioSettings.from_dict(saved, "saved") == ours
    clips = [_clip(n, i) for i, n in enumerate(LENGTHS)]
    out = ref(clips, return_tensors="np")  # one batch, padded to the longest
    for i, clip in enumerate(clips):
        mask = out["input_features_mask"][i]
        want = out["input_features"][i][mask]
        got = log_mel(clip, ours)
        assert got.shape == want.shape == (frame_count(len(clip), ours), ours.feature_size)
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got[:1], log_mel(clip * 0.5, ours)[:1])  # it sees the samples


def test_soft_token_counts_match_the_processor() -> None:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    s = AudioSettings()
    proc = Gemma4Processor.__new__(Gemma4Processor)  # the counting needs no tokenizer
    proc.feature_extractor, proc.audio_seq_length = Gemma4AudioFeatureExtractor(), 750
    for n in (321, 480, 481, 640, 641, 1600, 4001, 8123, 16_000):
        want = proc._compute_audio_num_tokens(np.zeros(n), 16_000)
        assert audio_soft_tokens(frame_count(n, s)) == want, n


def test_the_longest_clip_fills_audio_seq_length() -> None:
    s = AudioSettings(audio_seq_length=10)
    assert audio_soft_tokens(frame_count(s.max_samples, s)) == 10
    assert audio_soft_tokens(frame_count(s.max_samples + 1, s)) == 11


def test_settings_from_a_folder_and_refusals(tmp_path: Path) -> None:
    assert AudioSettings.from_folder(tmp_path) == AudioSettings()
    (tmp_path / "processor_config.json").write_text(
        json.dumps({"feature_extractor": {"feature_size": 64}, "audio_seq_length": 100})
    )
    s = AudioSettings.from_folder(tmp_path)
    assert (s.feature_size, s.audio_seq_length) == (64, 100)
    with pytest.raises(ConfigError, match="dither"):
        AudioSettings.from_dict({"dither": 1e-4}, "x")
    with pytest.raises(ConfigError, match="sampling_rate"):
        AudioSettings.from_dict({"sampling_rate": 44_100}, "x")
    with pytest.raises(ConfigError, match="per_bin_mean"):
        AudioSettings.from_dict({"per_bin_mean": [0.0] * 3}, "x")
