"""The live status page (/status): the engine is asked for a summary only while a page is open;
the page, its files and its event stream need the API key (a header, `?key=` or the cookie
that sets); and in headless Chromium, against a demo server under load, the page shows the
streams decoding and, once idle, the numbers /metrics shows."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from chromium import Browser
from test_server import ServedDemo
from test_server_bad_input import Http

from tensorfold.engine import status_snapshot
from tensorfold.server import status_feed
from tensorfold.server.status_feed import StatusFeed

KEY = "status-key"
MODEL = "lfm2_moe-demo"
LANES = 4


# -- the feed, in this process ----------------------------------------------------------------


class _Engine:
    def __init__(self) -> None:
        self.asks = 0

    def ask_summary(self, reply: Callable[[dict[str, Any]], None]) -> None:
        self.asks += 1
        pool = {"free": 3, "promised": 0, "live": 0, "store": 1, "host": None}
        threading.Thread(target=reply, args=({"pool": pool, "engine": {"passes": 1}},)).start()


class _Metrics:
    def totals(self) -> dict[str, float]:
        return {"generation_tokens": 5.0}


class _State:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.metrics = _Metrics()
        self.draining = False
        self.inflight = 0


def test_the_engine_is_asked_only_while_a_page_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_feed, "INTERVAL_S", 0.02)
    state = _State()

    async def watch() -> None:
        feed = StatusFeed(state)  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        assert state.engine.asks == 0  # nobody watches: never asked
        one, two = feed.subscribe(), feed.subscribe()
        first = [json.loads(await q.get()) for q in (one, two)]
        assert first[0] == first[1] and first[0]["seq"] == 1  # one ask for both pages
        assert first[0]["counters"] == {"generation_tokens": 5.0, "passes": 1}
        assert json.loads(feed.history_message())["points"] == [first[0]["point"]]
        feed.unsubscribe(one)
        assert json.loads(await two.get())["seq"] == 2
        feed.unsubscribe(two)
        await asyncio.sleep(0.1)
        asked = state.engine.asks
        await asyncio.sleep(0.2)
        assert state.engine.asks == asked and feed._task is not None and feed._task.done()

    asyncio.run(watch())


# -- a served demo ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(
        tmp_path_factory.mktemp("status"),
        "--parallel",
        str(LANES),
        api_key=KEY,
        env={"TF_KV_SHARE": "16"},
    )
    yield s
    s.stop()


def test_the_page_needs_the_key(server: ServedDemo) -> None:
    http = Http(server.base)
    for path in (
        "/status",
        "/status/events",
        "/status/status.js",
        "/status/status.css",
        f"/status?key={KEY}x",
    ):
        r = http.get(path)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        assert "/status?key=KEY" in r.text
    assert http.get(f"/v1/models?key={KEY}").status_code == 401  # the query is the page's only
    r = http.get("/?a=1")
    assert r.status_code == 302 and r.headers["location"] == "/status?a=1"
    r = http.get(f"/status?key={KEY}&a=1")  # the key goes into a cookie, out of the address
    assert r.status_code == 303 and r.headers["location"] == "/status?a=1"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"tensorfold_key={KEY};") and "HttpOnly" in cookie
    assert "Path=/status" in cookie and "SameSite=Strict" in cookie
    for headers in ({"Cookie": f"tensorfold_key={KEY}"}, {"Authorization": f"Bearer {KEY}"}):
        page = http.get("/status", headers=headers)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="/status/status.js"' in page.text and "cdn" not in page.text.lower()
        script = http.get("/status/status.js", headers=headers)
        assert script.status_code == 200 and "EventSource" in script.text


def test_the_event_stream_says_what_metrics_says(server: ServedDemo) -> None:
    metrics = server.wait_even()
    conn = Http(server.base).connect(timeout=30)
    try:
        conn.request("GET", f"/status/events?key={KEY}")
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        events = []
        while len(events) < 3:  # hello, history, the first summary
            lines = []
            while (line := r.readline().decode().rstrip("\n")) != "":
                lines.append(line)
            name = next((x[7:] for x in lines if x.startswith("event: ")), "message")
            events.append((name, json.loads(next(x[6:] for x in lines if x.startswith("data: ")))))
    finally:
        conn.close()
    (hello, h), (history, _), (message, s) = events
    assert (hello, history, message) == ("hello", "history", "message")
    assert h["model"] == MODEL and h["plan"]["lanes"] == LANES and h["plan"]["line"]
    assert h["asked"]["parallel"] == LANES and h["asked"]["kv_share"] == 16
    for state in ("free", "promised", "live", "shared", "store", "total"):
        assert s["pool"][state] == metrics[f"tensorfold_pool_pages{{state={state}}}"]
    assert s["pool"]["idle"] and s["pool"]["even"] and s["lanes"]["busy"] == 0
    assert s["store"]["max_states"] == 16 and s["counters"]["uneven"] == 0


# -- in a browser -----------------------------------------------------------------------------

PAGE_METRICS = """Object.fromEntries([...document.querySelectorAll('[data-metric]')].map(
    e => [e.dataset.metric, e.dataset.value === undefined ? null : Number(e.dataset.value)]))"""


LANES_AND_LIVE = """[Number(document.querySelector('#lanes-pages').dataset.value), Number(
    document.querySelector('[data-metric="tensorfold_pool_pages{state=live}"]').dataset.value)]"""


def _wait(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"the page never showed {what}")
        time.sleep(0.1)
    return value


def _expected(m: dict[str, float]) -> dict[str, float]:
    names = [
        f"tensorfold_pool_pages{{state={s}}}"
        for s in ("free", "promised", "live", "shared", "store", "total")
    ]
    names += [
        "tensorfold_generation_tokens_total",
        "tensorfold_prompt_tokens_total{source=cached}",
        "tensorfold_prompt_tokens_total{source=computed}",
        "tensorfold_lanes{state=busy}",
        "tensorfold_requests_waiting",
        "tensorfold_prompt_store_states",
        "tensorfold_prompt_store_evictions_total",
        "tensorfold_uneven_total",
        "tensorfold_draft_tokens_total",
        "tensorfold_draft_tokens_accepted_total",
    ]
    out = {name: m[name] for name in names}
    out["tensorfold_requests_total"] = sum(
        v for k, v in m.items() if k.startswith("tensorfold_requests_total{")
    )
    return out


def _chat(server: ServedDemo, i: int, seen: threading.Event) -> None:
    """A long streamed chat, read until the page has seen it decode; then it is cut (the
    server cancels it), so the test takes as long on a fast machine as on a slow one."""
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me about engine {i}."}],
        max_tokens=3000,
        temperature=0.8,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _ in stream:
        if seen.is_set():
            break
    stream.close()


def test_the_page_in_a_browser_matches_metrics(
    server: ServedDemo, chromium_exe: str, tmp_path: Path
) -> None:
    browser = Browser(chromium_exe, tmp_path / "profile")
    try:
        browser.open(f"{server.base}/status?key={KEY}")  # the cookie feeds its EventSource
        _wait(
            "a live stream",
            lambda: browser.eval("document.querySelector('#link').dataset.state") == "live",
        )
        seen = threading.Event()
        load = [threading.Thread(target=_chat, args=(server, i, seen)) for i in range(2)]
        for t in load:
            t.start()
        try:
            _wait(
                "two streams decoding",
                lambda: (
                    browser.eval(
                        "document.querySelectorAll('#streams tr[data-phase=decode]').length"
                    )
                    == 2
                ),
            )
            assert browser.eval(PAGE_METRICS)["tensorfold_lanes{state=busy}"] == 2
            held, live = browser.eval(LANES_AND_LIVE)  # read at once: one summary's
            assert held == live > 0
        finally:
            seen.set()
            for t in load:
                t.join()
        expected = _expected(server.wait_even())
        assert expected["tensorfold_generation_tokens_total"] > 0
        assert expected["tensorfold_prompt_store_states"] > 0
        _wait(
            f"what /metrics shows: {expected}",
            lambda: browser.eval(PAGE_METRICS) == expected,
            timeout=10,
        )
        kept = browser.eval("document.querySelectorAll('#tree .kept').length")
        assert kept == expected["tensorfold_prompt_store_states"]
        assert "UNEVEN" not in browser.eval("document.querySelector('#census').textContent")
        assert browser.errors == []
    finally:
        browser.close()
    server.wait_even()


# -- the summary's pieces ---------------------------------------------------------------------


def _live(prompt: int, cached: int, pos: int, generated: int = 0) -> Any:
    req = SimpleNamespace(
        id="req-1",
        prompt=[0] * prompt,
        arrival=time.monotonic() - 2,
        params=SimpleNamespace(max_tokens=9),
        forks=[],
    )
    return SimpleNamespace(
        req=req,
        slot=0,
        cached=cached,
        pos=pos,
        generated=[1] * generated,
        lease=SimpleNamespace(pages=[0, 1], promised=3),
        forks=[],
        prefilling=pos < prompt,
        drafts=None,
    )


@pytest.mark.parametrize(
    "prompt,cached,pos,phase",
    [
        (5000, 0, 0, ("prefill", 1, 3)),
        (5000, 0, 2048, ("prefill", 2, 3)),
        (5000, 0, 4096, ("prefill", 3, 3)),
        (5000, 2048, 2048, ("prefill", 1, 2)),
        (5000, 3000, 3000, ("prefill", 1, 2)),
        (100, 0, 0, ("prefill", 1, 1)),
        (100, 0, 100, ("decode",)),
    ],
)
def test_a_streams_phase_counts_passes_on_the_grid(
    prompt: int, cached: int, pos: int, phase: tuple[Any, ...]
) -> None:
    s = status_snapshot._stream(_live(prompt, cached, pos, 4), 2048, time.monotonic())
    assert (s["phase"], s.get("pass"), s.get("passes"))[: len(phase)] == phase
    assert (s["generated"], s["max_tokens"], s["pages"], s["promised"]) == (4, 9, 2, 3)
    assert s["age_s"] >= 2


def test_the_store_tree_is_cut_at_its_node_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    def chain(n: int) -> Any:  # a root, then n nodes each under the last
        root = node = SimpleNamespace(edge=(), depth=0, kept=None, children={})
        for i in range(n):
            kept = SimpleNamespace(
                pages=[i], snapshot=None, hits=i, host=None, used_at=time.monotonic()
            )
            child = SimpleNamespace(edge=(i,), depth=i + 1, kept=kept, children={})
            node.children[i] = child
            node = child
        return root

    monkeypatch.setattr(status_snapshot, "MAX_NODES", 5)
    budget = {"left": status_snapshot.MAX_NODES, "left_out": 0}
    tree = status_snapshot._node(chain(9), time.monotonic(), budget)
    depths = []
    while tree is not None:
        depths.append(tree["depth"])
        tree = tree["children"][0] if tree["children"] else None
    assert depths == [0, 1, 2, 3, 4] and budget["left_out"] == 5
