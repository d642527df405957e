"""Image and audio parts of chat messages as the API takes them: `{"type": "image_url",
"image_url": {"url": ..., "detail": ...}}` and `{"type": "input_audio", "input_audio": {"data":
base64, "format": "wav"}}` (OpenAI's shapes) among `{"type": "text", "text": ...}` parts.

A message's content becomes what the chat template reads: a string as before when it holds no
media (its text parts joined by newlines), else a list of `{"type": "text", "text": ...}`,
`{"type": "image"}` and `{"type": "audio"}` items in the parts' order, as transformers'
processors hand templates. The images are noted in the chat's order as `ImageRef`s, the clips as
`AudioRef`s; what they hold is read later (image_load.py, audio_decode.py). Torch-free and
Pillow-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..family.media import MediaRefused

DETAILS = ("auto", "low", "high")  # OpenAI's; every image is prepared as the family prepares it
ACCEPTED_PARTS = (
    '{"type": "text", "text": string}, {"type": "image_url", "image_url": {"url": '
    '"data:image/png;base64,..." or "https://..."}} or {"type": "input_audio", "input_audio": '
    '{"data": base64, "format": "wav"}}'
)
AUDIO_PART_FORMATS = ("wav", "mp3")  # OpenAI's; mp3 is refused when decoded (audio_decode.py)


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: where its bytes are (a data: or http(s): URL) and where the
    request named it, for errors ("messages[1].content[2]")."""

    url: str
    where: str


@dataclass(frozen=True)
class AudioRef:
    """One audio clip of a request: its base64 data, its format ("wav" or "mp3") and where the
    request named it."""

    data: str
    format: str
    where: str


def chat_content(
    content: Any, where: str, images: list[ImageRef], audio: list[AudioRef] | None = None
) -> Any:
    """A message's content for the chat template (a string, None, or text, image and audio
    items), appending its images to `images` and its clips to `audio` (None: audio parts are
    refused); a malformed part is a 400 naming it (MediaRefused for a media part, so that its
    message says what is accepted)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MediaRefused(f"{where}.content must be a string or an array of parts")
    items: list[dict[str, Any]] = []
    found: list[ImageRef] = []
    heard: list[AudioRef] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            items.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            found.append(ImageRef(_image_url(part, at), at))
            items.append({"type": "image"})
        elif kind == "input_audio" and audio is not None:
            heard.append(_input_audio(part, at))
            items.append({"type": "audio"})
        else:
            got = json.dumps(kind) if kind is not None else json.dumps(part)[:80]
            raise MediaRefused(f"{at} must be a part {ACCEPTED_PARTS}; got {got}")
    if not found and not heard:  # as before media: the text parts as one string
        return "\n".join(item["text"] for item in items)
    images.extend(found)
    if audio is not None:
        audio.extend(heard)
    return items


def _input_audio(part: dict[str, Any], at: str) -> AudioRef:
    """An input_audio part's clip: {"data": base64 string, "format": "wav" | "mp3"}."""
    value = part.get("input_audio")
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise MediaRefused(
            f'{at}.input_audio must be an object {{"data": base64 string, "format": "wav"}}; '
            f"got {json.dumps(value)[:80]}"
        )
    fmt = value.get("format", "wav")
    if fmt not in AUDIO_PART_FORMATS:
        raise MediaRefused(
            f"{at}.input_audio.format must be one of {', '.join(AUDIO_PART_FORMATS)}; got "
            f"{json.dumps(fmt)[:40]}"
        )
    return AudioRef(value["data"], str(fmt), at)


def _image_url(part: dict[str, Any], at: str) -> str:
    """The URL of an image_url part: {"url": ..., "detail": ...}, or the URL alone (vLLM's)."""
    value = part.get("image_url")
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("url"), str):
        raise MediaRefused(
            f'{at}.image_url must be an object {{"url": string, "detail": ...}}; got '
            f"{json.dumps(value)[:80]}"
        )
    detail = value.get("detail")
    if detail is not None and detail not in DETAILS:
        raise MediaRefused(
            f"{at}.image_url.detail must be one of {', '.join(DETAILS)}; got "
            f"{json.dumps(detail)[:40]}"
        )
    return str(value["url"])


def holds_parts(value: Any) -> bool:
    """Whether a completion's prompt holds parts (objects, such as an image_url part) where
    text or token ids belong."""
    if isinstance(value, dict):
        return True
    return isinstance(value, list) and any(holds_parts(v) for v in value)
