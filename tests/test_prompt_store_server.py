"""The prompt store through `tensorfold serve`: resumed == fresh over multi-turn chats with the
official openai client, and `tensorfold bench cache` (cold, then warm)."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from test_bench import tensorfold
from test_server import ServedDemo

WORDS = "lamp river cedar harbor violet meadow copper lantern willow ember".split()


def serve(tmp: Path, share: int) -> ServedDemo:
    env = {"TF_KV_SHARE": str(share)}  # 0: off (the store is on by default)
    return ServedDemo(tmp, "--parallel", "4", "--prompt-cache-gib", "0.05", env=env)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, ServedDemo]]:
    both = {share: serve(tmp_path_factory.mktemp(f"share{share}"), share) for share in (0, 64)}
    yield both
    for s in both.values():
        s.stop_idle()


def chat(url: str, seeded: bool, chats: int = 8, turns: int = 4):
    """All chats turn by turn, each turn's requests at once: (replies, cached tokens)."""
    client = openai.OpenAI(base_url=url, api_key="none")
    model = client.models.list().data[0].id
    histories = [[] for _ in range(chats)]
    replies, cached = [], []

    def one(c: int):
        r = client.chat.completions.create(
            model=model,
            messages=histories[c],
            max_tokens=10,
            temperature=0.8 if seeded else 0,
            seed=100 + c if seeded else None,
        )
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    with ThreadPoolExecutor(chats) as pool:
        for t in range(turns):
            for c in range(chats):
                rng = random.Random(c * 10 + t)
                histories[c].append(
                    {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(40))}
                )
            done = list(pool.map(one, range(chats)))
            replies.append([text for text, _ in done])
            cached.append([n for _, n in done])
            for c, (text, _) in enumerate(done):
                histories[c].append({"role": "assistant", "content": text})
    return replies, cached


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_resumed_equals_fresh_through_the_server(servers, seeded):
    fresh, fresh_cached = chat(servers[0].url, seeded)
    resumed, cached = chat(servers[64].url, seeded)
    assert resumed == fresh
    assert all(n == 0 for turn in fresh_cached for n in turn)
    assert all(n > 0 for turn in cached[1:] for n in turn), cached
    for s in servers.values():
        s.wait_even()
    m = servers[64].metrics()
    assert m["tensorfold_prompt_store_states"] > 0
    assert m["tensorfold_prompt_tokens_total{source=cached}"] > 0


def test_bench_cache_cold_then_warm(servers):
    url = servers[64].url
    args = ["bench", "cache", "--url", url, "--words", "600", "--seed", "5", "--json"]
    r = tensorfold(*args, "--require-cold")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout.strip().splitlines()[-1])["rows"]
    assert rows[0]["cached_tokens"] == 0 and all(row["cached_tokens"] > 0 for row in rows[1:])
    again = tensorfold(*args, "--require-cold")  # the store holds it now: not cold
    assert again.returncode == 1 and "not cold" in again.stdout, again.stdout
    servers[64].wait_even()
