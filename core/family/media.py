"""Media in a prompt: images and audio clips (later video) whose rows a family's tower computes.

A prompt with media holds, at the rows a piece fills, the family's placeholder token ids. The
family's `FamilyModel.encode_media` gives those rows' embeddings, which the prompt pass writes
over the placeholders' own (`ForwardPass.place_embeds`). The prompt store keys those rows by a
hash of the piece's pixels (`store_key`), so the same image in a resumed chat is a hit and a
different image never is.

A family that takes media answers the `media_processor` hook with a `MediaProcessor`: it turns
a decoded image into the model's inputs and says how many rows it fills and which ids stand for
it. The chat template writes one `placeholder_id` token where each image goes, as transformers'
processors expect; `expand_media` replaces each by the family's ids for that image. A family
that also takes audio ("audio" in its `kinds`) is an `AudioProcessor` as well: the template
writes one `audio_placeholder_id` token where each clip goes, and `expand_media` replaces those
by `audio_ids`, each kind's placeholders matched with that kind's pieces in order. Torch-free.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from PIL import Image

KEY_BITS = 62  # a media key is 1 <= key < 2**62; -key marks its rows in the store's keys

MediaKind = Literal["image", "video", "audio"]


class MediaRefused(ValueError):
    """Media a request cannot have: undecodable, too large, too many, a URL not allowed, or a
    family without a tower. The message names the problem and what would be accepted; `param`
    names the request field, for an OpenAI-shaped 400."""

    def __init__(self, message: str, param: str | None = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, eq=False)
class MediaPiece:
    """One image (or video, or audio clip) in a prompt.

    start: prompt position of its first row; it fills rows [start, start + rows).
    key: a hash of its pixels and how they were prepared (`media_key`); the prompt store's key
        of its rows is -key.
    inputs: the family's prepared input (pixel values, grid sizes...), opaque to the core, read
        only by the family's `encode_media`.
    block: its rows attend to each other both ways in some of the family's layers (Gemma 4's
        sliding layers), so a pass computes them together: the lanes never cut a prompt pass
        inside a block, and keep no state inside one.
    """

    start: int
    rows: int
    key: int
    inputs: Any
    block: bool = False
    kind: MediaKind = "image"

    @property
    def end(self) -> int:
        return self.start + self.rows


def media_key(*parts: bytes | str | int) -> int:
    """A key for a piece of media from what identifies it (its decoded pixels, their size and
    mode, the preparation's settings): 1 <= key < 2**62."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return (int.from_bytes(h.digest(), "little") & ((1 << KEY_BITS) - 1)) | 1


def store_key(prompt: Sequence[int], media: Sequence[MediaPiece]) -> list[int]:
    """The prompt store's key of a prompt: its ids, with each media row -key (never a token
    id), so a kept prefix matches only where the same media fills the same rows."""
    key = list(prompt)
    for m in media:
        key[m.start : m.end] = [-m.key] * m.rows
    return key


def tower_batches(sizes: Sequence[int], bound: int) -> list[range]:
    """The pieces (by index) a tower runs together: runs of consecutive pieces whose sizes
    (patches, rows: what the tower's memory grows with) sum to at most `bound`, the size the
    memory plan counts the tower at; a piece past it alone. A family whose tower keeps each
    piece's rows free of the others' (rows through batch-invariant products, attention within a
    piece) saves a pass's fixed cost per piece this way, and no bit changes."""
    out: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > bound:
            out.append(range(start, i))
            start, total = i, 0
        total += size
    if sizes:
        out.append(range(start, len(sizes)))
    return out


@runtime_checkable
class MediaProcessor(Protocol):
    """A family's preparation of media, built by its `media_processor` hook from the checkpoint.

    kinds: the kinds of media it takes ("image", ...).
    placeholder: the text the chat template writes where an image goes (Gemma 4 "<|image|>");
        it tokenizes to `placeholder_id`, one token per image.
    block: whether an image's rows form a block (MediaPiece.block).
    prepare_image(image): the model's input for one decoded RGB image and the rows it fills.
    image_ids(rows): the ids that replace an image's placeholder token, and the offset of its
        first filled row among them (Gemma 4: begin-of-image, `rows` image tokens,
        end-of-image, offset 1).
    """

    kinds: frozenset[str]
    placeholder: str
    placeholder_id: int
    block: bool

    def prepare_image(self, image: "Image.Image") -> tuple[Any, int]: ...

    def image_ids(self, rows: int) -> tuple[list[int], int]: ...


@runtime_checkable
class AudioProcessor(Protocol):
    """The audio side of a family's MediaProcessor whose `kinds` hold "audio".

    audio_placeholder: the text the chat template writes where a clip goes (Gemma 4
        "<|audio|>"); it tokenizes to `audio_placeholder_id`, one token per clip.
    prepare_audio(samples, rate): the model's input for one mono clip of float samples in
        [-1, 1] at `rate` Hz, and the rows it fills; MediaRefused for a rate or a length the
        family does not take.
    audio_ids(rows): the ids that replace a clip's placeholder token, and the offset of its
        first filled row among them (Gemma 4: begin-of-audio, `rows` audio tokens,
        end-of-audio, offset 1). A clip's rows are never a block.
    """

    audio_placeholder: str
    audio_placeholder_id: int

    def prepare_audio(self, samples: Any, rate: int) -> tuple[Any, int]: ...

    def audio_ids(self, rows: int) -> tuple[list[int], int]: ...


def expand_media(
    ids: Sequence[int],
    processor: MediaProcessor,
    images: Sequence[tuple[Any, int, int]],
    audio: Sequence[tuple[Any, int, int]] = (),
) -> tuple[list[int], list[MediaPiece]]:
    """A tokenized prompt with one `processor.placeholder_id` token per image and (a processor
    taking audio) one `audio_placeholder_id` token per clip, each kind in order, and the images
    and clips as (inputs, rows, key): the prompt with each placeholder replaced by its piece's
    ids, and the pieces in prompt order. Refuses a prompt whose count of a kind's placeholders
    is not the count of that kind's pieces."""
    slots: list[tuple[int, MediaKind]] = []
    takes_audio = "audio" in processor.kinds and isinstance(processor, AudioProcessor)
    for i, t in enumerate(ids):
        if t == processor.placeholder_id:
            slots.append((i, "image"))
        elif takes_audio and t == processor.audio_placeholder_id:  # type: ignore[attr-defined]
            slots.append((i, "audio"))
    _count(slots, "image", len(images), processor.placeholder, "image_url")
    if audio and not takes_audio:
        raise MediaRefused("the model takes no audio; send input_audio parts to one that does")
    if takes_audio:
        placeholder = processor.audio_placeholder  # type: ignore[attr-defined]
        _count(slots, "audio", len(audio), placeholder, "input_audio")
    queues = {"image": iter(images), "audio": iter(audio)}
    out: list[int] = []
    pieces: list[MediaPiece] = []
    last = 0
    for pos, kind in slots:
        inputs, rows, key = next(queues[kind])
        out.extend(ids[last:pos])
        if kind == "audio":
            fill, offset = processor.audio_ids(rows)  # type: ignore[attr-defined]
            pieces.append(MediaPiece(len(out) + offset, rows, key, inputs, False, "audio"))
        else:
            fill, offset = processor.image_ids(rows)
            pieces.append(MediaPiece(len(out) + offset, rows, key, inputs, processor.block))
        out.extend(fill)
        last = pos + 1
    out.extend(ids[last:])
    return out, pieces


def _count(
    slots: Sequence[tuple[int, str]], kind: str, want: int, placeholder: str, part: str
) -> None:
    placed = sum(1 for _, k in slots if k == kind)
    if placed != want:
        noun = "image" if kind == "image" else "audio clip"
        raise MediaRefused(
            f"the chat template placed {placed} {noun}(s) ({placeholder!r}) but the request has "
            f"{want}; each {part} part must be rendered by the template"
        )
