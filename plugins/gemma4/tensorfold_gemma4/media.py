"""Gemma 4's images and audio in a prompt: the `media_processor` hook's answer
(tensorfold.family.media).

The chat template writes the image token (`<|image|>` in Gemma 4's tokenizer) once where each
image goes; the core replaces it, as Gemma4Processor does, by begin-of-image, one image token
for each soft token, end-of-image. The image tokens' rows are a block (MediaPiece.block) when
the text config has `use_bidirectional_attention: "vision"`: they attend to each other both ways
in the sliding layers, as modeling_gemma4.py's `create_masks_for_vision_model` lets them (its
`mm_token_type_ids` mark the image tokens alone, not begin- and end-of-image).

An image is prepared as Gemma4ImageProcessorPil does it (image_processing.py), with the
settings of the checkpoint's preprocessor_config.json (or processor_config.json), and kept as
its valid patches only (`GemmaImage`), which `Gemma4Model.encode_media` runs through the tower.

A checkpoint with an `audio_config` (the E-models) also takes audio: the template writes the
audio token (`<|audio|>`) once where each clip goes, replaced as Gemma4Processor does by
begin-of-audio, one audio token per soft token, end-of-audio. A clip is 16 kHz mono samples,
turned into log-mel frames as Gemma4AudioFeatureExtractor does (audio_features.py, settings
from processor_config.json's `feature_extractor`) and kept as `GemmaClip`. Audio tokens are not
a block: `create_masks_for_vision_model`'s blocks are image and video tokens only
(`mm_token_type_ids` 1 and 2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from tensorfold.family.media import MediaRefused

from .audio_config import AudioConfig, audio_config
from .audio_features import AUDIO_RATE, AudioSettings, audio_soft_tokens, frame_count, log_mel
from .config import ConfigError
from .image_processing import ImageSettings, preprocess
from .vision_config import vision_config

if TYPE_CHECKING:
    from PIL.Image import Image

IMAGE_TOKEN = "<|image|>"  # Gemma 4's image token, where a folder has no tokenizer to ask
AUDIO_TOKEN = "<|audio|>"  # and its audio token
DEFAULT_IDS = {"image_token_id": 258_880, "boi_token_id": 255_999, "eoi_token_id": 258_882}
# Gemma4Config's audio ids; end-of-audio is `eoa_token_index` there
DEFAULT_AUDIO_IDS = {"audio_token_id": 258_881, "boa_token_id": 256_000, "eoa_token_index": 258_883}


@dataclass(frozen=True, eq=False)
class GemmaImage:
    """One prepared image: its patches row-major and their (x, y) in its patch grid."""

    pixel_values: torch.Tensor  # [P, 3·patch²] fp32 in [0, 1] (rescaled, maybe normalised)
    positions: torch.Tensor  # [P, 2] int64


@dataclass(frozen=True, eq=False)
class GemmaClip:
    """One prepared audio clip: its valid log-mel frames."""

    features: torch.Tensor  # [frames, mel] fp32


@dataclass(frozen=True)
class Gemma4Audio:
    """The audio side of Gemma4Images: the feature settings and the ids a clip fills."""

    settings: AudioSettings
    placeholder: str
    placeholder_id: int  # audio_token_id
    begin_id: int  # begin-of-audio (boa_token_id)
    end_id: int  # end-of-audio (eoa_token_index)


@dataclass(frozen=True)
class Gemma4Images:
    """A tensorfold.family.media.MediaProcessor for Gemma 4's vision tower, and with `audio`
    an AudioProcessor for its audio tower. `settings` None: a checkpoint without a vision
    tower (its image token stays the placeholder id, and an image is refused)."""

    settings: ImageSettings | None
    placeholder: str
    placeholder_id: int
    begin_id: int  # begin-of-image (boi_token_id)
    end_id: int  # end-of-image (eoi_token_id)
    block: bool
    kinds: frozenset[str] = frozenset({"image"})
    audio: Gemma4Audio | None = None

    @property
    def max_rows(self) -> int:
        """The most rows an image fills (the processor's max_soft_tokens)."""
        return self.settings.max_soft_tokens if self.settings is not None else 0

    @property
    def audio_placeholder(self) -> str:
        return self._audio().placeholder

    @property
    def audio_placeholder_id(self) -> int:
        return self._audio().placeholder_id

    def _audio(self) -> Gemma4Audio:
        if self.audio is None:
            raise MediaRefused("this gemma4 checkpoint has no audio tower (no audio_config)")
        return self.audio

    def prepare_audio(self, samples: Any, rate: int) -> tuple[GemmaClip, int]:
        """A mono clip's log-mel frames and its soft-token count; MediaRefused for a rate
        other than 16 kHz, a clip too short for one soft token, or one past the processor's
        audio_seq_length."""
        audio = self._audio()
        s = audio.settings
        if rate != AUDIO_RATE:
            raise MediaRefused(
                f"gemma4 takes audio at {AUDIO_RATE} Hz, as its feature extractor does; the clip "
                f"is {rate} Hz: resample it to {AUDIO_RATE} Hz mono"
            )
        rows = audio_soft_tokens(frame_count(len(samples), s))
        if rows == 0:
            raise MediaRefused(
                f"the clip has {len(samples)} samples, too short for one audio token "
                f"(at least {s.frame_length + 1 - s.frame_length // 2})"
            )
        if rows > s.audio_seq_length:
            raise MediaRefused(
                f"the clip is {len(samples) / AUDIO_RATE:.2f} s; gemma4 takes at most "
                f"{s.max_samples / AUDIO_RATE:.2f} s a clip ({s.audio_seq_length} audio tokens)"
            )
        features = torch.from_numpy(log_mel(samples, s))
        return GemmaClip(features), rows

    def audio_ids(self, rows: int) -> tuple[list[int], int]:
        audio = self._audio()
        return [audio.begin_id, *[audio.placeholder_id] * rows, audio.end_id], 1

    def prepare_image(self, image: "Image") -> tuple[GemmaImage, int]:
        """An RGB image's patches and its soft-token count; MediaRefused for one the processor
        cannot fit to its patches (a side too thin to resize)."""
        if self.settings is None:
            raise MediaRefused("this gemma4 checkpoint has no vision tower (no vision_config)")
        try:
            batch = preprocess([image], self.settings)
        except ValueError as e:
            raise MediaRefused(f"gemma4 cannot prepare the image: {e}") from None
        rows = batch.soft_tokens[0]
        patches = rows * self.settings.pooling_kernel_size**2
        inputs = GemmaImage(
            batch.pixel_values[0, :patches].clone(), batch.image_position_ids[0, :patches].clone()
        )
        return inputs, rows

    def image_ids(self, rows: int) -> tuple[list[int], int]:
        return [self.begin_id, *[self.placeholder_id] * rows, self.end_id], 1


def media_processor(folder: Path | None, config: Mapping[str, Any]) -> Gemma4Images | None:
    """The hook's answer for a Gemma 4 checkpoint: None without a vision_config or an
    audio_config. `folder` None (a demo or dummy model): the processors' and tokenizer's
    defaults. Refuses settings the towers would not take (patch size, pooling, mel bins) and a
    media token id the tokenizer lacks."""
    source = "config.json" if folder is None else str(Path(folder) / "config.json")
    vision = vision_config(config, source)
    acfg = audio_config(config, source)
    if vision is None and acfg is None:
        return None
    text = config.get("text_config") or {}
    ids = {key: int(config.get(key, default)) for key, default in DEFAULT_IDS.items()}
    audio = _audio(folder, config, acfg) if acfg is not None else None
    kinds = frozenset({"image"} if vision is not None else ()) | (
        frozenset({"audio"}) if audio is not None else frozenset()
    )
    if vision is None:
        return Gemma4Images(
            settings=None,
            placeholder=IMAGE_TOKEN,
            placeholder_id=ids["image_token_id"],
            begin_id=ids["boi_token_id"],
            end_id=ids["eoi_token_id"],
            block=False,
            kinds=kinds,
            audio=audio,
        )
    if folder is None:
        settings = ImageSettings(
            patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size
        )
        placeholder = IMAGE_TOKEN
    else:
        settings = ImageSettings.from_folder(Path(folder))
        placeholder = token_text(Path(folder), ids["image_token_id"])
    if (settings.patch_size, settings.pooling_kernel_size) != (
        vision.patch_size,
        vision.pooling_kernel_size,
    ):
        raise ConfigError(
            f"{folder}: the image processor's patch_size {settings.patch_size} and "
            f"pooling_kernel_size {settings.pooling_kernel_size} differ from the vision tower's "
            f"{vision.patch_size} and {vision.pooling_kernel_size}"
        )
    return Gemma4Images(
        settings=settings,
        placeholder=placeholder,
        placeholder_id=ids["image_token_id"],
        begin_id=ids["boi_token_id"],
        end_id=ids["eoi_token_id"],
        block=text.get("use_bidirectional_attention") == "vision",
        kinds=kinds,
        audio=audio,
    )


def _audio(folder: Path | None, config: Mapping[str, Any], acfg: AudioConfig) -> Gemma4Audio:
    """The audio side from processor_config.json (defaults without a folder); refuses mel bins
    the tower's input projection would not take."""
    ids = {key: int(config.get(key, default)) for key, default in DEFAULT_AUDIO_IDS.items()}
    if "eoa_token_id" in config:  # a config naming it as the other ids are named
        ids["eoa_token_index"] = int(config["eoa_token_id"])
    if folder is None:
        settings, placeholder = AudioSettings(), AUDIO_TOKEN
    else:
        settings = AudioSettings.from_folder(Path(folder))
        placeholder = token_text(Path(folder), ids["audio_token_id"])
    mel = settings.feature_size
    # two stride-2 convs: ⌈⌈mel / 2⌉ / 2⌉ = ⌈mel / 4⌉ bins a channel
    if -(-mel // 4) * acfg.subsampling_conv_channels[1] != acfg.subsampled_width:
        raise ConfigError(
            f"{folder}: the feature extractor's {mel} mel bins do not fit the audio tower's "
            f"input projection ({acfg.subsampled_width} wide from subsampling_conv_channels "
            f"{list(acfg.subsampling_conv_channels)})"
        )
    return Gemma4Audio(
        settings=settings,
        placeholder=placeholder,
        placeholder_id=ids["audio_token_id"],
        begin_id=ids["boa_token_id"],
        end_id=ids["eoa_token_index"],
    )


def token_text(folder: Path, token_id: int) -> str:
    """The text of token `token_id` in the folder's tokenizer.json (an added token, or the
    vocabulary's), which the chat template writes for an image or a clip."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no tokenizer.json to name the media token {token_id}")
    raw = json.loads(path.read_text())
    for added in raw.get("added_tokens") or []:
        if added.get("id") == token_id:
            return str(added["content"])
    vocab = (raw.get("model") or {}).get("vocab") or {}
    if isinstance(vocab, list) and 0 <= token_id < len(vocab):  # Unigram: [piece, score] by id
        return str(vocab[token_id][0])
    if isinstance(vocab, dict):
        for text, i in vocab.items():
            if i == token_id:
                return str(text)
    raise ConfigError(f"{path}: no token has the media token id {token_id} of config.json")
