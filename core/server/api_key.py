"""Where `serve`'s API key comes from, and the warning when a reachable server has none.

Precedence: --api-key, then --api-key-file (the file's first line; keeps the key out of the
process list), then TF_API_KEY. An empty key given on purpose (`--api-key ""`, an empty file)
is refused rather than read as "no key".
"""

from __future__ import annotations

import hmac
import ipaddress
from pathlib import Path

from ..config.settings import SettingsError

LOOPBACK_NAMES = ("localhost", "ip6-localhost")
KEYED_PATHS = ("/tokenize", "/detokenize")  # beside /v1/: they run the tokenizer's workers


def needs_key(path: str) -> bool:
    """Whether a request to `path` needs the key (when the server has one)."""
    return path.startswith("/v1/") or path in KEYED_PATHS


def resolve_api_key(flag: str | None, file: str | None, setting: str | None) -> str | None:
    """The key to require, or None. Raises SettingsError for an empty or unreadable key."""
    if flag is not None and file is not None:
        raise SettingsError("--api-key and --api-key-file are both given; use one")
    if flag is not None:
        if not flag.strip():
            raise SettingsError(
                '--api-key "" is empty; give a key, or leave the flag out to serve without one'
            )
        return flag.strip()
    if file is not None:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise SettingsError(f"--api-key-file {file}: cannot read it ({exc})") from None
        lines = text.splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise SettingsError(f"--api-key-file {file} holds no key (its first line is empty)")
        return key
    if setting is None:  # unset or empty
        return None
    if not setting.strip():
        raise SettingsError(
            "TF_API_KEY holds only spaces; give a key, or leave it empty to serve without one"
        )
    return setting.strip()


def key_matches(given: str | None, key: bytes) -> bool:
    """`given` is the key (compared in constant time)."""
    return given is not None and hmac.compare_digest(given.strip().encode(errors="replace"), key)


def bearer_matches(authorization: str, key: bytes) -> bool:
    """An `Authorization: Bearer KEY` header's value carries the key."""
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and key_matches(given, key)


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, key: str | None) -> str | None:
    """The start-up warning for a server others can reach that needs no key, or None."""
    if key is not None or is_loopback(host):
        return None
    return (
        f"listening on {host} with no API key: anyone who can reach this address can use "
        "the model; set --api-key-file, --api-key or TF_API_KEY"
    )
