"""`serve`'s API key: --api-key, --api-key-file or TF_API_KEY; an empty key is refused; a
server others can reach with no key warns; a 401 says `WWW-Authenticate: Bearer`."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from test_server import FAMILY, ServedDemo, refused_before_the_weights

from tensorfold.config.settings import SettingsError
from tensorfold.server.api_key import exposure_warning, resolve_api_key


def test_the_flag_then_the_file_then_the_setting(tmp_path: Path) -> None:
    file = tmp_path / "key"
    file.write_text("from-file\nignored second line\n")
    assert resolve_api_key("from-flag", None, "from-env") == "from-flag"
    assert resolve_api_key(None, str(file), "from-env") == "from-file"
    assert resolve_api_key(None, None, "from-env") == "from-env"
    assert resolve_api_key(None, None, None) is None


@pytest.mark.parametrize(
    "flag,file_text,says",
    [
        ("", None, '--api-key "" is empty'),
        ("  ", None, '--api-key "" is empty'),
        (None, "", "holds no key"),
        (None, "\n\nkey-on-line-3\n", "holds no key"),
        ("k", "k2", "both given"),
    ],
)
def test_empty_or_double_keys_are_refused(
    tmp_path: Path, flag: str | None, file_text: str | None, says: str
) -> None:
    file = None
    if file_text is not None:
        (tmp_path / "key").write_text(file_text)
        file = str(tmp_path / "key")
    with pytest.raises(SettingsError, match=says):
        resolve_api_key(flag, file, None)


def test_a_blank_tf_api_key_is_refused() -> None:
    with pytest.raises(SettingsError, match="TF_API_KEY holds only spaces"):
        resolve_api_key(None, None, "   ")
    assert resolve_api_key(None, None, " padded ") == "padded"


def test_an_unreadable_key_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read it"):
        resolve_api_key(None, str(tmp_path / "missing"), None)


@pytest.mark.parametrize(
    "host,key,warns",
    [
        ("127.0.0.1", None, False),
        ("127.0.0.2", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("192.0.2.7", None, True),
        ("my-host.example", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_a_reachable_server_without_a_key_warns(host: str, key: str | None, warns: bool) -> None:
    warning = exposure_warning(host, key)
    assert (warning is not None) == warns
    if warning:
        assert host in warning and "--api-key-file" in warning and "TF_API_KEY" in warning


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--api-key", ""], '--api-key "" is empty'),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key"),
    ],
)
def test_serve_refuses_an_empty_key_before_the_weights(
    tmp_path: Path, flags: list[str], says: str
) -> None:
    refused_before_the_weights(tmp_path, ["--family", FAMILY, *flags], says)


def test_tf_api_key_is_required_and_401_says_bearer(tmp_path: Path) -> None:
    s = ServedDemo(tmp_path, env={"TF_API_KEY": "env-key"})
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client().models.list()  # ServedDemo's client sends "none"
        assert e.value.response.headers["www-authenticate"] == "Bearer"
        s.api_key = "env-key"
        assert s.client().models.list().data[0].id == "lfm2_moe-demo"
        assert "no API key" not in s.logs()  # 127.0.0.1: no warning
    finally:
        rc, _ = s.stop()
    assert rc == 0
