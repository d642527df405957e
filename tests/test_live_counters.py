"""Live counters: generated tokens are counted as they are sampled, not when a request ends
(every choice of n, none twice), and the pool's census says what the lanes hold while they hold
it (pages a stream shares with the prompt store count as live)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from test_server import ServedDemo
from test_server_bad_input import Http

from tensorfold.memory.kv_pool import KVPool

MODEL = "lfm2_moe-demo"
LANES = 4
LONG = 3000  # max_tokens of a stream that is cut long before its end
TOKENS = "tensorfold_generation_tokens_total"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    s = ServedDemo(tmp_path_factory.mktemp("live"), "--parallel", str(LANES))
    yield s
    s.stop()


def _long_chat(server: ServedDemo, i: int, n: int = 1) -> Any:
    return server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me about engine {i}."}],
        max_tokens=LONG,
        temperature=0.8,
        n=n,
        stream=True,
        extra_body={"ignore_eos": True},
    )


@pytest.mark.parametrize("n", [1, 2])
def test_generated_tokens_are_counted_while_a_stream_runs(server: ServedDemo, n: int) -> None:
    before = server.wait_even()[TOKENS]
    stream = _long_chat(server, 0, n)
    seen, scraped = 0, []
    try:
        for chunk in stream:  # bounded: the stream ends at LONG tokens a choice
            seen += sum(1 for c in chunk.choices if c.delta.content is not None)
            if seen >= 16 * (len(scraped) + 1):
                scraped.append(server.metrics()[TOKENS] - before)
                if len(scraped) == 2:
                    break
    finally:
        stream.close()
    assert len(scraped) == 2
    assert 0 < scraped[0] < scraped[1]  # moving, the request not ended
    assert server.wait_even()[TOKENS] - before < n * LONG


@pytest.mark.parametrize("n", [1, 3])
def test_a_finished_request_counts_each_token_once(server: ServedDemo, n: int) -> None:
    before = server.wait_even()[TOKENS]
    reply = server.client().completions.create(
        model=MODEL, prompt="The little", max_tokens=7, n=n, extra_body={"ignore_eos": True}
    )
    assert reply.usage is not None and reply.usage.completion_tokens == 7 * n
    assert server.wait_even()[TOKENS] - before == 7 * n


def _summaries(server: ServedDemo, limit: int = 200) -> Iterator[dict[str, Any]]:
    """The status feed's summaries, at most `limit` of them."""
    conn = Http(server.base).connect(timeout=30)
    try:
        conn.request("GET", "/status/events")
        r = conn.getresponse()
        assert r.status == 200
        for _ in range(limit + 2):  # hello and history first
            lines = []
            for _ in range(100):
                line = r.readline().decode().rstrip("\n")
                if line == "":
                    break
                lines.append(line)
            name = next((x[7:] for x in lines if x.startswith("event: ")), "message")
            if name == "message":
                yield json.loads(next(x[6:] for x in lines if x.startswith("data: ")))
    finally:
        conn.close()


def test_the_pool_counts_what_the_lanes_hold(server: ServedDemo) -> None:
    server.wait_even()
    decoding = threading.Event()
    done = threading.Event()

    def chat(i: int) -> None:
        stream = _long_chat(server, i)
        for _ in stream:
            decoding.set()
            if done.is_set():
                break
        stream.close()

    load = [threading.Thread(target=chat, args=(i,)) for i in range(LANES)]
    for t in load:
        t.start()
    try:
        decoding.wait(60)
        summary = next(
            s
            for s in _summaries(server)
            if s["lanes"]["busy"] == LANES
            and all(x["phase"] == "decode" for x in s["lanes"]["streams"])
        )
    finally:
        done.set()
        for t in load:
            t.join(60)
    pool, lanes = summary["pool"], summary["lanes"]
    held = sum(x["pages"] for x in lanes["streams"])  # distinct prompts: no page held twice
    assert pool["live"] == held > 0
    assert lanes["pages"] == held
    assert pool["free"] + pool["live"] + pool["store"] == pool["total"]
    assert 0 <= pool["shared"] <= pool["live"]
    server.wait_even()


def test_a_page_the_store_keeps_and_a_stream_holds_is_live() -> None:
    pool = KVPool(8, page_rows=4)
    lease = pool.lease(8)
    pages = lease.cover(8)
    pool.hold(pages[:1], store=True)  # the prompt store keeps the first page
    census = pool.census()
    assert (census.live, census.store, census.free) == (2, 0, 6)
    assert census.shared == 1
    lease.release()
    census = pool.census()
    assert (census.live, census.store, census.free, census.shared) == (0, 1, 7, 0)
    assert census.idle_even
