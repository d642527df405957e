"""Image parts of chat messages as the API takes them: `{"type": "image_url", "image_url":
{"url": ..., "detail": ...}}` among `{"type": "text", "text": ...}` parts.

A message's content becomes what the chat template reads: a string as before when it holds no
image (its text parts joined by newlines), else a list of `{"type": "text", "text": ...}` and
`{"type": "image"}` items in the parts' order, as transformers' processors hand templates. The
images are noted in the chat's order as `ImageRef`s; what they hold is read later
(image_load.py). Torch-free and Pillow-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..family.media import MediaRefused

DETAILS = ("auto", "low", "high")  # OpenAI's; every image is prepared as the family prepares it
ACCEPTED_PARTS = (
    '{"type": "text", "text": string} or {"type": "image_url", "image_url": {"url": '
    '"data:image/png;base64,..." or "https://..."}}'
)


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: where its bytes are (a data: or http(s): URL) and where the
    request named it, for errors ("messages[1].content[2]")."""

    url: str
    where: str


def chat_content(content: Any, where: str, images: list[ImageRef]) -> Any:
    """A message's content for the chat template (a string, None, or text and image items),
    appending its images to `images`; a malformed part is a 400 naming it (MediaRefused for an
    image part, so that its message says what is accepted)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise MediaRefused(f"{where}.content must be a string or an array of parts")
    items: list[dict[str, Any]] = []
    found: list[ImageRef] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            items.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            found.append(ImageRef(_image_url(part, at), at))
            items.append({"type": "image"})
        else:
            got = json.dumps(kind) if kind is not None else json.dumps(part)[:80]
            raise MediaRefused(f"{at} must be a part {ACCEPTED_PARTS}; got {got}")
    if not found:  # as before images: the text parts as one string
        return "\n".join(item["text"] for item in items)
    images.extend(found)
    return items


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
