"""Shutdown as docs/serving.md says, by real signals to a server process: the first signal
stops admission and lets requests run on up to --shutdown-timeout; then, or at a second
signal, each open stream gets a last chunk with finish_reason "abort" and [DONE], a request
that is not streamed gets its partial completion with that reason, and the process exits
soon after with an even census."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

from test_server import ServedDemo
from test_server_bad_input import Http

LONG = {
    "model": "lfm2_moe-demo",
    "prompt": "The little",
    "max_tokens": 3000,
    "ignore_eos": True,
    "temperature": 0,
}
EXIT_BOUND_S = 20.0  # generous: the exit takes about a second unloaded


def events(lines: Any) -> list[Any]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def start_stream(api: Http, opened: list[Any], **extra: Any) -> threading.Thread:
    """A streamed request on a thread; its events land in opened[0] once it ends."""
    first = threading.Event()

    def run() -> None:
        with api.stream("/v1/completions", {**LONG, "stream": True, **extra}) as (status, lines):
            assert status == 200
            got = []
            for line in lines:
                got.append(line)
                if line.startswith("data: "):
                    first.set()
            opened.append(events(got))

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(60), "the stream never started"
    return thread


def assert_aborted(stream: list[Any], usage: bool) -> None:
    assert stream[-1] == "[DONE]"
    chunks = [e for e in stream[:-1] if e["choices"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert not any(c["choices"][0]["finish_reason"] for c in chunks[:-1])
    if usage:
        assert stream[-2]["usage"]["completion_tokens"] < LONG["max_tokens"]


def wait_exit(s: ServedDemo, since: float) -> tuple[int, str, float]:
    rc, out = s.stop(timeout=60)  # SIGTERM again only if still running: see the callers
    return rc, out, time.monotonic() - since


def test_the_timeout_aborts_what_is_still_open(tmp_path: Path) -> None:
    s = ServedDemo(tmp_path, "--parallel", "2", "--shutdown-timeout", "1")
    api = Http(s.base)
    opened: list[Any] = []
    whole: list[Any] = []
    stream = start_stream(api, opened, stream_options={"include_usage": True})
    plain = threading.Thread(target=lambda: whole.append(api.post("/v1/completions", json=LONG)))
    plain.start()
    deadline = time.monotonic() + 30
    while s.metrics()["tensorfold_lanes{state=busy}"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    stream.join(EXIT_BOUND_S)
    plain.join(EXIT_BOUND_S)
    assert opened and whole, "a request did not end"
    assert_aborted(opened[0], usage=True)
    reply = whole[0]
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and choice["text"]
    assert 1 <= reply.json()["usage"]["completion_tokens"] < LONG["max_tokens"]
    s.proc.wait(EXIT_BOUND_S)
    rc, out, took = wait_exit(s, signalled)
    assert rc == 0, s.logs()[-3000:]
    assert out.strip().splitlines()[-1].startswith("kv pool idle: promised 0"), out
    assert took < 1 + EXIT_BOUND_S
    assert "aborting the requests in flight (--shutdown-timeout 1 s)" in s.logs()


def test_a_second_signal_aborts_at_once(tmp_path: Path) -> None:
    s = ServedDemo(tmp_path, "--parallel", "1", "--shutdown-timeout", "600")
    api = Http(s.base)
    opened: list[Any] = []
    stream = start_stream(api, opened)
    s.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 10
    while (r := api.get("/health")).status_code != 503:  # admission stops...
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert r.json()["error"]["message"] == "the server is shutting down"
    refused = api.post("/v1/completions", json={**LONG, "max_tokens": 1})
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert stream.is_alive()  # ...while the open stream goes on
    s.proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    stream.join(EXIT_BOUND_S)
    assert opened, "the stream did not end"
    assert_aborted(opened[0], usage=False)
    s.proc.wait(EXIT_BOUND_S)
    rc, out, took = wait_exit(s, signalled)
    assert rc == 0, s.logs()[-3000:]
    assert out.strip().splitlines()[-1].startswith("kv pool idle: promised 0"), out
    assert took < EXIT_BOUND_S
    assert "aborting the requests in flight (a second signal)" in s.logs()
