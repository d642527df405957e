"""A request's images from their URLs to their encoded bytes, within the server's limits:
`data:` URLs decoded from base64, `http(s)` URLs fetched (image_fetch.py) only from hosts
TF_ALLOWED_MEDIA_DOMAINS lists, every other scheme refused. Each refusal is a MediaRefused
naming the image and what is accepted. The bytes are decoded into pixels later, by a prompt
worker (image_decode.py).

Settings: TF_MAX_IMAGES, TF_MAX_IMAGE_MIB, TF_MAX_IMAGE_PIXELS, TF_MEDIA_FETCH_TIMEOUT_S,
TF_ALLOWED_MEDIA_DOMAINS (--allowed-media-domains).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from typing import Sequence
from urllib.parse import urlsplit

from ..family.media import MediaRefused
from .image_fetch import fetch_image
from .image_parts import ImageRef
from .media_limits import MediaLimits

SCHEMES = "data: (base64), or http(s): from a host --allowed-media-domains lists"
_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),", re.IGNORECASE)


def check_images(refs: Sequence[ImageRef], limits: MediaLimits) -> None:
    """The refusals that need no byte of an image: too many, a scheme not taken, a host not
    listed."""
    if len(refs) > limits.max_images:
        raise MediaRefused(
            f"the request holds {len(refs)} images; the limit is {limits.max_images} a request "
            "(TF_MAX_IMAGES): send fewer"
        )
    for ref in refs:
        scheme = ref.url.split(":", 1)[0].lower() if ":" in ref.url else ""
        if scheme == "data":
            continue
        if scheme not in ("http", "https"):
            shown = f"scheme {scheme!r}" if scheme else f"no scheme ({ref.url[:40]!r})"
            raise MediaRefused(
                f"{ref.where}: image URLs with {shown} are not taken; send {SCHEMES}"
            )
        host = urlsplit(ref.url).hostname
        if not limits.allows(host):
            listed = ", ".join(limits.allowed_domains) or "none (the default)"
            raise MediaRefused(
                f"{ref.where}: the image URL's host {host!r} is not one the server may fetch "
                f"from (--allowed-media-domains / TF_ALLOWED_MEDIA_DOMAINS lists: {listed}); "
                "send the image as a data: URL"
            )


def data_url_bytes(url: str, where: str, limits: MediaLimits) -> bytes:
    """A `data:[type][;...];base64,...` URL's bytes, refused past the byte limit before decoding
    (from the base64 text's length) and after."""
    found = _DATA_URL.match(url)
    if found is None or ";base64" not in found["params"].lower():
        raise MediaRefused(
            f"{where}: a data: URL must be base64, as data:image/png;base64,... (got {url[:40]!r})"
        )
    text = "".join(url[found.end() :].split())  # line breaks some encoders put in
    if len(text) // 4 * 3 > limits.max_bytes + 3:
        raise limits.too_many_bytes(where, len(text) // 4 * 3)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaRefused(f"{where}: the data: URL's base64 does not decode") from None
    if len(data) > limits.max_bytes:
        raise limits.too_many_bytes(where, len(data))
    if not data:
        raise MediaRefused(f"{where}: the data: URL holds no bytes")
    return data


async def load_images(refs: Sequence[ImageRef], limits: MediaLimits) -> list[bytes]:
    """Each image's encoded bytes, in order: data: URLs decoded off the loop, http(s) URLs
    fetched at once (each within its time limit). Checks check_images first."""
    check_images(refs, limits)
    loop = asyncio.get_running_loop()

    async def one(ref: ImageRef) -> bytes:
        if ref.url[:5].lower() == "data:":
            return await loop.run_in_executor(None, data_url_bytes, ref.url, ref.where, limits)
        return await fetch_image(ref.url, ref.where, limits)

    tasks = [asyncio.ensure_future(one(ref)) for ref in refs]
    try:
        return [await task for task in tasks]
    finally:  # a refusal (or the client leaving) stops the other fetches
        for task in tasks:
            task.cancel()


def load_images_now(refs: Sequence[ImageRef], limits: MediaLimits) -> list[bytes]:
    """load_images for code without an event loop (the offline API): data: URLs here, URLs on
    a loop of a thread of their own (so that a caller's running loop is never re-entered)."""
    check_images(refs, limits)
    if all(ref.url[:5].lower() == "data:" for ref in refs):
        return [data_url_bytes(ref.url, ref.where, limits) for ref in refs]
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, load_images(refs, limits)).result()
