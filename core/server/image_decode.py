"""A request's images (and audio clips) from encoded bytes to the family's inputs, where prompts
are made (a prompt
worker process, or the offline API): each decoded with Pillow as RGB (PNG, JPEG, WebP, GIF's
first frame; transparency over white, as transformers' and vLLM's loaders do), its size read
from the header and refused past TF_MAX_IMAGE_PIXELS before a pixel is decoded, keyed by a hash
of its pixels (`media_key`), prepared by the family's `MediaProcessor`; each audio clip decoded
(audio_decode.py), keyed by a hash of its samples and rate, prepared by the processor's audio
side (`AudioProcessor`); and the tokenized prompt with each placeholder token replaced by its
image's or clip's ids (`expand_media`).

The family's processor comes from its `media_processor` hook, built once a process from a
`MediaSource` (what a worker needs to build it: the family's hooks and the checkpoint).
"""

from __future__ import annotations

import io
import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..family.media import (
    AudioProcessor,
    MediaPiece,
    MediaProcessor,
    MediaRefused,
    expand_media,
    media_key,
)
from .audio_decode import decode_audio

if TYPE_CHECKING:
    from PIL import Image

    from ..family.checkpoint import Checkpoint
    from ..family.spec import FamilySpec

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
ACCEPTED = "PNG, JPEG, WebP or GIF (its first frame)"


@dataclass(frozen=True)
class MediaSource:
    """How to build the family's MediaProcessor in any process: the family's name, its hooks
    object ("module:attr", FamilySpec.hooks), the checkpoint folder and its config.json."""

    family: str
    hooks: str
    folder: str
    config: dict[str, Any] = field(hash=False, compare=False)

    @classmethod
    def of(cls, spec: FamilySpec, checkpoint: Checkpoint) -> MediaSource:
        return cls(spec.name, spec.hooks, str(checkpoint.path), checkpoint.config)


_processors: dict[MediaSource, MediaProcessor | None] = {}
_lock = threading.Lock()


def media_processor(source: MediaSource) -> MediaProcessor | None:
    """The family's processor (its `media_processor` hook's answer; None: it takes no media),
    built once a process."""
    with _lock:
        if source not in _processors:
            from pathlib import Path

            from ..family.plugins import family_plugin_manager
            from ..family.spec import FamilySpec

            spec = FamilySpec(name=source.family, load="", build_demo="", hooks=source.hooks)
            hook = family_plugin_manager(spec, []).hook
            _processors[source] = hook.media_processor(
                folder=Path(source.folder), config=source.config
            )
        return _processors[source]


def refuse_without_tower(source: MediaSource) -> MediaProcessor:
    """The family's processor for images; a MediaRefused when the family takes none."""
    processor = media_processor(source)
    if processor is None or "image" not in processor.kinds:
        raise MediaRefused(
            f"the {source.family} family takes no images; send text content only (image_url "
            "parts need a family with a vision tower, and a checkpoint with its vision_config)"
        )
    return processor


def refuse_without_audio(source: MediaSource) -> AudioProcessor:
    """The family's processor for audio; a MediaRefused when the family takes none."""
    processor = media_processor(source)
    if processor is None or "audio" not in processor.kinds:
        raise MediaRefused(
            f"the {source.family} family (this checkpoint) takes no audio; send text content "
            "only (input_audio parts need a family with an audio tower, and a checkpoint with "
            "its audio_config)"
        )
    assert isinstance(processor, AudioProcessor), "a processor taking audio is an AudioProcessor"
    return processor


@dataclass(frozen=True)
class ImageJob:
    """A prompt's media as a prompt worker takes them: the images' encoded bytes in the chat's
    order, where the request named each, the family's processor's source and the pixel limit;
    and the audio clips' bytes, formats and places in the chat's order, and the length limit."""

    blobs: tuple[bytes, ...]
    wheres: tuple[str, ...]
    source: MediaSource
    max_pixels: int
    clips: tuple[bytes, ...] = ()
    clip_formats: tuple[str, ...] = ()
    clip_wheres: tuple[str, ...] = ()
    max_seconds: float = 30.0


def decode_image(blob: bytes, where: str, max_pixels: int) -> Image.Image:
    """The image's pixels as RGB; MediaRefused for bytes Pillow cannot read, a format not
    taken, or a size past max_pixels (read from the header, before decoding)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():  # the size is ours to judge (TF_MAX_IMAGE_PIXELS)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(blob), formats=FORMATS) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise MediaRefused(
                        f"{where}: the image is {width} x {height} = {width * height} pixels; "
                        f"the limit is {max_pixels} (TF_MAX_IMAGE_PIXELS)"
                    )
                image.seek(0)  # GIF (and animated WebP): the first frame
                return _rgb(image)
    except MediaRefused:
        raise
    except UnidentifiedImageError:
        raise MediaRefused(f"{where}: {_unknown(blob)}; send {ACCEPTED}") from None
    except Image.DecompressionBombError as exc:  # past twice Pillow's own limit
        raise MediaRefused(f"{where}: the image is too large to decode: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated, corrupt
        raise MediaRefused(f"{where}: the image does not decode: {exc}") from None


def _unknown(blob: bytes) -> str:
    """What bytes of no format taken are: an image of another format (its header read by
    Pillow), or none."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(blob)) as image:
            return f"the image is {image.format}, a format not taken"
    except Exception:  # any failure to read a header: not an image
        return "the bytes are not an image Pillow reads"


def _rgb(image: Image.Image) -> Image.Image:
    from PIL import Image

    if image.mode == "RGB":
        return image.copy()
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def prepare_images(job: ImageJob) -> list[tuple[Any, int, int]]:
    """Each image as expand_media takes it: (the family's inputs, its rows, its key)."""
    processor = refuse_without_tower(job.source)
    out = []
    for blob, where in zip(job.blobs, job.wheres):
        image = decode_image(blob, where, job.max_pixels)
        key = media_key(image.tobytes(), image.width, image.height)
        inputs, rows = processor.prepare_image(image)
        out.append((inputs, rows, key))
    return out


def prepare_clips(job: ImageJob) -> list[tuple[Any, int, int]]:
    """Each audio clip as expand_media takes it: (the family's inputs, its rows, its key)."""
    processor = refuse_without_audio(job.source)
    out = []
    for blob, fmt, where in zip(job.clips, job.clip_formats, job.clip_wheres):
        clip = decode_audio(blob, fmt, where, job.max_seconds)
        key = media_key(b"audio", clip.samples.tobytes(), clip.rate)
        try:
            inputs, rows = processor.prepare_audio(clip.samples, clip.rate)
        except MediaRefused as exc:
            raise MediaRefused(f"{where}: {exc}") from None
        out.append((inputs, rows, key))
    return out


def place_images(
    ids: Sequence[int], marks: Sequence[int], job: ImageJob
) -> tuple[list[int], tuple[int, ...], tuple[MediaPiece, ...]]:
    """A tokenized chat's ids with each image's (and clip's) placeholder token replaced by its
    ids, its marks moved past them, and its pieces. The placeholders are counted before any
    image or clip is decoded (expand_media refuses a count unlike the media's)."""
    processor = refuse_without_tower(job.source) if job.blobs else media_processor(job.source)
    audio_processor = refuse_without_audio(job.source) if job.clips else None
    assert processor is not None
    unseen = [(None, 0, 0)]
    expand_media(ids, processor, unseen * len(job.blobs), unseen * len(job.clips))  # counts
    images = prepare_images(job) if job.blobs else []
    clips = prepare_clips(job) if job.clips else []
    expanded, pieces = expand_media(ids, processor, images, clips)
    audio_id = audio_processor.audio_placeholder_id if audio_processor is not None else None
    grown: list[tuple[int, int]] = []  # (placeholder position, ids it grew by)
    queue = {"image": iter(images), "audio": iter(clips)}
    for i, t in enumerate(ids):
        if t == processor.placeholder_id:
            fill = processor.image_ids(next(queue["image"])[1])[0]
        elif audio_id is not None and t == audio_id:
            fill = audio_processor.audio_ids(next(queue["audio"])[1])[0]  # type: ignore[union-attr]
        else:
            continue
        grown.append((i, len(fill) - 1))
    moved = tuple(m + sum(g for p, g in grown if p < m) for m in marks)
    return expanded, moved, tuple(pieces)
