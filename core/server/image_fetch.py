"""Fetching an image URL for a request (aiohttp's client, on the event loop): only from hosts
TF_ALLOWED_MEDIA_DOMAINS lists, a redirect followed only to such a host (at most
MAX_REDIRECTS), the body read up to TF_MAX_IMAGE_MIB, all within TF_MEDIA_FETCH_TIMEOUT_S.
Each failure is a MediaRefused naming the image and why.
"""

from __future__ import annotations

import asyncio
from urllib.parse import urljoin, urlsplit

import aiohttp

from ..family.media import MediaRefused
from .media_limits import MediaLimits

MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
CHUNK = 64 * 1024


async def fetch_image(url: str, where: str, limits: MediaLimits) -> bytes:
    """The body of `url`, fetched as the module says."""
    try:
        async with asyncio.timeout(limits.fetch_timeout_s):
            async with aiohttp.ClientSession(trust_env=False) as session:
                for _ in range(MAX_REDIRECTS + 1):
                    url_host = urlsplit(url)
                    if url_host.scheme not in ("http", "https") or not limits.allows(
                        url_host.hostname
                    ):
                        raise MediaRefused(
                            f"{where}: the image URL redirects to {url[:80]!r}, whose host "
                            "--allowed-media-domains does not list; the server follows a "
                            "redirect only to a listed host"
                        )
                    async with session.get(url, allow_redirects=False) as resp:
                        if resp.status in REDIRECTS and "Location" in resp.headers:
                            url = urljoin(url, resp.headers["Location"])
                            continue
                        if resp.status != 200:
                            raise MediaRefused(
                                f"{where}: fetching the image URL got HTTP {resp.status}"
                            )
                        return await _body(resp, where, limits)
                raise MediaRefused(
                    f"{where}: the image URL redirects more than {MAX_REDIRECTS} times"
                )
    except TimeoutError:
        raise MediaRefused(
            f"{where}: fetching the image URL took more than {limits.fetch_timeout_s:g} s "
            "(TF_MEDIA_FETCH_TIMEOUT_S)"
        ) from None
    except aiohttp.ClientError as exc:
        raise MediaRefused(
            f"{where}: fetching the image URL failed: {type(exc).__name__}: {exc}"
        ) from None


async def _body(resp: aiohttp.ClientResponse, where: str, limits: MediaLimits) -> bytes:
    """The body, refused as soon as it passes the byte limit (before reading it when its
    Content-Length says so)."""
    if resp.content_length is not None and resp.content_length > limits.max_bytes:
        raise limits.too_many_bytes(where, resp.content_length)
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(CHUNK):
        size += len(chunk)
        if size > limits.max_bytes:
            raise limits.too_many_bytes(where, None)
        chunks.append(chunk)
    if not size:
        raise MediaRefused(f"{where}: the image URL's body is empty")
    return b"".join(chunks)
