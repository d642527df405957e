"""CORS (--allowed-origins, TF_ALLOWED_ORIGINS): a browser's preflight is answered before the
API-key check, every response to an allowed origin carries Access-Control-Allow-Origin, and
with the setting unset nothing changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_server import LAUNCH, ServedDemo, served
from test_server_bad_input import Http, check_error

KEY = "cors-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALLOWED = "http://a.example"
OTHER = "https://evil.example"
CHAT = {
    "model": "lfm2_moe-demo",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "temperature": 0,
}
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(
        tmp_path_factory,
        "cors-key",
        "--parallel",
        "2",
        "--allowed-origins",
        f"{ALLOWED}, https://B.example:8443/",
        api_key=KEY,
    )


@pytest.fixture(scope="module")
def anyone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    """No key; every origin allowed, through the setting rather than the flag."""
    s = ServedDemo(tmp_path_factory.mktemp("cors-any"), env={"TF_ALLOWED_ORIGINS": "*"})
    yield s
    assert s.stop()[0] == 0


@pytest.fixture(scope="module")
def unset(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(tmp_path_factory.mktemp("cors-unset"))
    yield s
    assert s.stop()[0] == 0


def allowed_headers(headers: dict[str, str], origin: str) -> None:
    assert headers["access-control-allow-origin"] == origin
    assert {"GET", "POST", "OPTIONS"} & set(headers["access-control-allow-methods"].split(", "))
    assert "OPTIONS" in headers["access-control-allow-methods"]
    assert "access-control-allow-headers" in headers
    assert "Origin" in headers["vary"]


def test_preflight_is_answered_before_the_key_check(keyed: ServedDemo) -> None:
    http = Http(keyed.base)  # no key: a browser sends none on a preflight
    for origin in (ALLOWED, "https://b.example:8443"):
        r = http.request("OPTIONS", "/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT})
        assert r.status_code == 204, r.text
        allowed_headers(r.headers, origin)
        assert r.headers["access-control-allow-methods"] == "OPTIONS, POST"
        assert (
            r.headers["access-control-allow-headers"] == PREFLIGHT["Access-Control-Request-Headers"]
        )
    r = http.request("OPTIONS", "/v1/models", headers={"Origin": ALLOWED, **PREFLIGHT})
    assert r.status_code == 204 and "GET" in r.headers["access-control-allow-methods"]


def test_preflight_from_another_origin_is_refused_by_name(keyed: ServedDemo) -> None:
    r = Http(keyed.base).request(
        "OPTIONS", "/v1/completions", headers={"Origin": OTHER, **PREFLIGHT}
    )
    error = check_error(r, 403)
    assert OTHER in error["message"] and "--allowed-origins" in error["message"]
    assert "access-control-allow-origin" not in r.headers and "Origin" in r.headers["vary"]


def test_preflight_to_no_route_is_not_approved(keyed: ServedDemo) -> None:
    """It is answered as any request there: the key check's 401 (a 404 with the key)."""
    http = Http(keyed.base, {"Origin": ALLOWED, **PREFLIGHT})
    check_error(http.request("OPTIONS", "/v1/nothing"), 401)
    r = http.request("OPTIONS", "/v1/nothing", headers=AUTH)
    check_error(r, 404)
    allowed_headers(r.headers, ALLOWED)


def test_every_response_to_an_allowed_origin_carries_the_headers(keyed: ServedDemo) -> None:
    http = Http(keyed.base, {"Origin": ALLOWED})
    r = http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 200, r.text
    allowed_headers(r.headers, ALLOWED)
    r = http.get("/v1/models", headers=AUTH)
    assert r.status_code == 200
    allowed_headers(r.headers, ALLOWED)
    denied = http.post("/v1/chat/completions", json=CHAT)  # no key: the error is readable
    check_error(denied, 401)
    allowed_headers(denied.headers, ALLOWED)
    conn = http.connect()  # an event stream: its headers go out before any token
    try:
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"prompt": "The little", "max_tokens": 3, "stream": True}).encode(),
            headers={"Content-Type": "application/json", "Origin": ALLOWED, **AUTH},
        )
        streamed = conn.getresponse()
        assert streamed.status == 200
        assert streamed.read().decode().rstrip().endswith("data: [DONE]")
        allowed_headers({k.lower(): v for k, v in streamed.getheaders()}, ALLOWED)
    finally:
        conn.close()
    r = http.get("/health")
    allowed_headers(r.headers, ALLOWED)


def test_other_origins_get_no_allow_origin(keyed: ServedDemo) -> None:
    for headers in ({"Origin": OTHER}, {}):
        r = Http(keyed.base, {**headers, **AUTH}).post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200  # served (the browser, not the server, withholds it)
        assert not any(h.startswith("access-control-") for h in r.headers)
        assert "Origin" in r.headers["vary"]
    keyed.wait_even()


def test_star_allows_any_origin_without_a_key(anyone: ServedDemo) -> None:
    http = Http(anyone.base, {"Origin": OTHER})
    r = http.request("OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert r.status_code == 204
    allowed_headers(r.headers, OTHER)
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    allowed_headers(r.headers, OTHER)
    anyone.wait_even()


def test_unset_changes_nothing(unset: ServedDemo) -> None:
    http = Http(unset.base, {"Origin": ALLOWED})
    r = http.request("OPTIONS", "/v1/chat/completions", headers=PREFLIGHT)
    check_error(r, 405)
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert not any(h.startswith("access-control-") for h in r.headers) and "vary" not in r.headers
    unset.wait_even()


@pytest.mark.parametrize("value", ["https://a.example/path", "*,http://a.example", "a.example"])
def test_a_malformed_origin_is_refused_before_the_weights(tmp_path: Path, value: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_DEMO_CACHE=str(tmp_path / "demo"))
    r = subprocess.run(
        [sys.executable, "-c", LAUNCH, "serve", "--allowed-origins", value],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("tensorfold: error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "--allowed-origins" in errors[0] and "scheme://host[:port]" in errors[0]
    assert "serving" not in r.stdout
