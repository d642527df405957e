"""Load: 64 streaming clients at once against the served demo on loopback, each sending a fixed
number of requests. No request fails, the census is even afterwards, and the server's memory
comes back. How long it took is printed, never asserted (times belong in the benchmarks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import openai
import pytest
from test_server import ServedDemo, rss_bytes, served

CLIENTS = 64
ROUNDS = 3  # requests each client sends, one after the other
RSS_SLACK = 96 * 1024 * 1024
MODEL = "lfm2_moe-demo"
PROMPTS = (
    "The little engine",
    "What is the capital of France?",
    "Numbers: one, two,",
    "She opened the window and looked at the garden.",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedDemo]:
    yield from served(tmp_path_factory, "load", "--parallel", "8")


async def one(client: openai.AsyncOpenAI, i: int, n: int) -> int:
    """One streaming request; returns its completion tokens, checked against max_tokens."""
    max_tokens = 4 + (i * 7 + n) % 29
    kw = dict(
        model=MODEL,
        max_tokens=max_tokens,
        temperature=0.7,
        seed=i,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    if i % 2:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": PROMPTS[i % 4]}], logprobs=i % 4 == 1, **kw
        )  # type: ignore[call-overload]
    else:
        stream = await client.completions.create(prompt=PROMPTS[i % 4], **kw)  # type: ignore
    finish, usage = None, None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
        usage = chunk.usage or usage
    assert finish == "length" and usage is not None and usage.completion_tokens == max_tokens
    return max_tokens


async def load(server: ServedDemo, rounds: int) -> tuple[int, int, list[str]]:
    """CLIENTS clients, each sending `rounds` requests one after the other (a request that hangs
    fails on the client's timeout)."""
    client = openai.AsyncOpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    failures: list[str] = []
    counts = [0, 0]

    async def user(i: int) -> None:
        for n in range(rounds):
            try:
                tokens = await one(client, i, n)
                counts[0] += 1
                counts[1] += tokens
            except Exception as exc:
                failures.append(f"client {i}: {type(exc).__name__}: {exc}")

    try:
        await asyncio.gather(*(user(i) for i in range(CLIENTS)))
    finally:
        await client.close()
    return counts[0], counts[1], failures


def test_64_streaming_clients(server: ServedDemo) -> None:
    _, _, failures = asyncio.run(load(server, 1))  # one request each: warm
    assert not failures, failures[:5]
    server.wait_even()
    rss_before = rss_bytes(server.proc.pid)
    started = time.monotonic()
    requests, tokens, failures = asyncio.run(load(server, ROUNDS))
    took = time.monotonic() - started
    assert not failures, failures[:5]
    assert requests == ROUNDS * CLIENTS
    m = server.wait_even(timeout=30)
    assert m["tensorfold_requests_total{endpoint=chat,reason=length}"] >= requests // 2
    rss_after = rss_bytes(server.proc.pid)
    assert rss_after - rss_before < RSS_SLACK, (rss_before, rss_after)
    print(
        f"{requests} requests, {tokens} tokens in {took:.1f} s; server RSS "
        f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
