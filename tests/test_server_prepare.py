"""A request's preparation (JSON, chat template, tokenizer) against a real `serve`, bounded and
cancellable: a chat of too many messages and a prompt too big for the window are refused before
the template or the tokenizer runs; while a prompt worker is busy with a request, /health and
other streams answer; a preparation past TF_PREPARE_TIMEOUT_S is a 400 naming it; clients that
leave mid-preparation free their workers; SIGTERM during a preparation stops the process.

The demo checkpoint is served with a chat template that renders forever when the last message
says "spin": a stand-in for any pathological template or prompt.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_server import ServedDemo
from test_server_bad_input import Http, Reply, check_error

SPIN = (
    "{% if messages[-1]['content'] == 'spin' %}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
)
SPINNING = {"messages": [{"role": "user", "content": "spin"}], "max_tokens": 4}
HELLO = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
MAX_MESSAGES = 64
PREPARE_TIMEOUT_S = 15  # long enough for a stream to run beside a spinning request
WORKERS = 2
EXIT_BOUND_S = 30.0  # generous: the exit takes about a second unloaded


def spinning_demo(folder: Path) -> Path:
    """The demo checkpoint with SPIN before its chat template."""
    from tensorfold_lfm2_moe.demo import build_demo

    built = build_demo(folder / "cache")
    spin = folder / "spin-demo"
    shutil.copytree(built, spin)
    config_path = spin / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = SPIN + config["chat_template"]
    config_path.write_text(json.dumps(config))
    return spin


def serve(tmp: Path, **env: str) -> ServedDemo:
    return ServedDemo(
        tmp,
        "--model",
        str(spinning_demo(tmp)),
        "--parallel",
        "2",
        env={
            "TF_MAX_MESSAGES": str(MAX_MESSAGES),
            "TF_PREPARE_TIMEOUT_S": str(PREPARE_TIMEOUT_S),
            "TF_PREPARE_WORKERS": str(WORKERS),
            **env,
        },
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = serve(tmp_path_factory.mktemp("prepare"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server: ServedDemo) -> Http:
    return Http(server.base)


def prompt_workers(pid: int) -> set[int]:
    """The server's prompt worker processes (spawned children; killed ones are gone)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid and b"spawn_main" in cmdline:
            found.add(int(proc.name))
    return found


def workers_settle(server: ServedDemo, count: int) -> set[int]:
    for _ in range(200):
        found = prompt_workers(server.proc.pid)
        if len(found) == count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{len(found)} prompt workers, not {count}")


def in_background(api: Http, body: dict[str, Any], out: list[Reply]) -> threading.Thread:
    thread = threading.Thread(
        target=lambda: out.append(api.post("/v1/chat/completions", json=body, timeout=120))
    )
    thread.start()
    return thread


def leave_mid_prepare(server: ServedDemo, body: dict[str, Any]) -> socket.socket:
    """Send a whole request and keep the connection open without reading (close() leaves)."""
    host, port = server.base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    raw = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\n" + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw
    )
    return sock


def test_a_chat_of_too_many_messages_is_refused(api: Http) -> None:
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "a"}
        for i in range(MAX_MESSAGES + 1)
    ]
    error = check_error(
        api.post("/v1/chat/completions", json={"messages": messages}), 400, "messages"
    )
    assert "TF_MAX_MESSAGES" in error["message"] and str(MAX_MESSAGES) in error["message"]
    ok = api.post("/v1/chat/completions", json={"messages": messages[:-1], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_prompt_too_big_for_the_window_is_refused_before_tokenizing(api: Http) -> None:
    big = "hello world " * 200_000  # 2.4 MB: more bytes than 4,096 tokens can hold
    for path, body, param in (
        ("/v1/completions", {"prompt": big, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}, "messages"),
    ):
        error = check_error(api.post(path, json=body), 400, param)
        assert error["code"] == "context_length_exceeded"
        assert f"{len(big)} bytes" in error["message"], error  # counted, not tokenized
    assert api.post("/v1/chat/completions", json=HELLO).status_code == 200


def test_others_go_on_while_a_request_is_prepared_then_its_deadline_ends_it(
    server: ServedDemo, api: Http
) -> None:
    spinning: list[Reply] = []
    thread = in_background(api, SPINNING, spinning)
    time.sleep(0.5)  # a worker is rendering it
    chunks, usage = 0, {}
    with api.stream(
        "/v1/chat/completions",
        {
            **HELLO,
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as (status, lines):
        assert status == 200
        for line in lines:
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                chunks += bool(event["choices"])
                usage = event.get("usage") or usage
            assert api.get("/health", timeout=30).status_code == 200
    assert chunks >= 3 and usage["completion_tokens"] == 24
    assert thread.is_alive() and not spinning  # all of that while the spin was prepared
    thread.join(PREPARE_TIMEOUT_S * 4)
    error = check_error(spinning[0], 400, "messages")
    assert "TF_PREPARE_TIMEOUT_S" in error["message"] and "Traceback" not in error["message"]
    assert api.post("/v1/chat/completions", json=HELLO).status_code == 200
    workers_settle(server, WORKERS)


def test_clients_that_leave_mid_prepare_free_their_workers(server: ServedDemo, api: Http) -> None:
    before = prompt_workers(server.proc.pid)
    socks = [leave_mid_prepare(server, SPINNING) for _ in range(2 * WORKERS)]
    time.sleep(1.0)  # the workers have two of them, the others wait
    for sock in socks:
        sock.close()
    ok = api.post("/v1/chat/completions", json=HELLO, timeout=60)
    assert ok.status_code == 200, ok.text
    after = workers_settle(server, WORKERS)  # replaced, none leaked
    assert not before & after, (before, after)


def test_sigterm_during_a_prepare_stops_the_server(tmp_path: Path) -> None:
    server = serve(tmp_path, TF_PREPARE_TIMEOUT_S="600")
    try:
        workers = prompt_workers(server.proc.pid)  # started before the address was printed
        sock = leave_mid_prepare(server, SPINNING)
        time.sleep(1.0)
        rc, out = server.stop(timeout=EXIT_BOUND_S)
        sock.close()
        assert rc == 0, server.logs()[-3000:]
        assert out.strip().splitlines()[-1].startswith("kv pool idle: promised 0"), out
        assert len(workers) == WORKERS and not any(  # killed (gone, or a zombie: no cmdline)
            Path(f"/proc/{pid}/cmdline").exists() and Path(f"/proc/{pid}/cmdline").read_bytes()
            for pid in workers
        )
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
