"""What a request's images and audio clips may cost: how many, their bytes, their pixels or
seconds, the time to fetch one, the hosts their URLs may name (TF_MAX_IMAGES, TF_MAX_IMAGE_MIB,
TF_MAX_IMAGE_PIXELS, TF_MEDIA_FETCH_TIMEOUT_S, TF_ALLOWED_MEDIA_DOMAINS, TF_MAX_AUDIO_CLIPS,
TF_MAX_AUDIO_MIB, TF_MAX_AUDIO_SECONDS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..family.media import MediaRefused

if TYPE_CHECKING:
    from ..config.settings import Settings

MIB = 1024 * 1024


@dataclass(frozen=True)
class MediaLimits:
    """What a request's images and audio clips may cost (the TF_* settings above)."""

    max_images: int = 8
    max_bytes: int = 20 * MIB  # an image's encoded bytes
    max_pixels: int = 8192 * 8192  # an image's width x height, read from its header
    fetch_timeout_s: float = 10.0  # one URL, its redirects included
    allowed_domains: tuple[str, ...] = ()  # hosts whose http(s) URLs are fetched; (): none
    max_clips: int = 4  # audio clips a request
    max_audio_bytes: int = 10 * MIB  # a clip's encoded bytes
    max_audio_seconds: float = 30.0  # a clip's length, read from its header

    @classmethod
    def from_settings(cls, settings: Settings) -> MediaLimits:
        return cls(
            max_images=settings.max_images,
            max_bytes=int(settings.max_image_mib * MIB),
            max_pixels=settings.max_image_pixels,
            fetch_timeout_s=settings.media_fetch_timeout_s,
            allowed_domains=settings.media_domains,
            max_clips=settings.max_audio_clips,
            max_audio_bytes=int(settings.max_audio_mib * MIB),
            max_audio_seconds=settings.max_audio_seconds,
        )

    def allows(self, host: str | None) -> bool:
        """Whether a URL's host (as urlsplit gives it: lower-case, IPv6 without brackets) is
        listed; each listed host matches exactly."""
        return host is not None and host in (h.strip("[]") for h in self.allowed_domains)

    def too_many_bytes(self, where: str, size: int | None) -> MediaRefused:
        """The refusal of an image of `size` bytes (None: more than the limit, length unknown)."""
        held = f"{size} bytes" if size is not None else "more bytes than that"
        return MediaRefused(
            f"{where}: the image is {held}; the limit is {self.max_bytes} bytes "
            f"({self.max_bytes / MIB:g} MiB: TF_MAX_IMAGE_MIB)"
        )
