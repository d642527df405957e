"""The streaming path's shortcuts give what the plain path gives: a text chunk's pre-encoded frame
is byte for byte the chunk encoded whole, and the mailbox hands events to the loop in order with
one wake-up for a burst. Also runs bench/experiments/host_round.py briefly (no time is
asserted)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tensorfold.engine.sampling import SamplingParams
from tensorfold.server.openai_api import Parsed
from tensorfold.server.openai_replies import Choices, TokenTexts, sse
from tensorfold.server.state import Mailbox

TEXTS = ["a", " word", 'é\n"\\\x00\u2028 😀', "</s>", "\x00tensorfold text\x00"]


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_text_frames_equal_whole_chunks(kind: str, usage: bool, n: int) -> None:
    parsed = Parsed(
        kind,
        [1, 2, 3],
        SamplingParams(max_tokens=8),
        stream=True,  # type: ignore[arg-type]
        include_usage=usage,
        n=n,
    )
    texts = TokenTexts(SimpleNamespace(hf=SimpleNamespace(decoder=None)))  # type: ignore[arg-type]
    replies = Choices(parsed, "demo-model", 7, texts, n)
    for reply in replies.replies:
        for i, text in enumerate(TEXTS):
            assert reply.sse_chunks(text, [], i) == sse(reply.chunk(text, [], i)), text
            assert reply.text_sse(text) == sse(reply.chunk(text, [], 0))


def test_mailbox_keeps_order_and_wakes_the_loop_once_a_burst() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        box = Mailbox(loop)
        a: asyncio.Queue[int] = asyncio.Queue()
        b: asyncio.Queue[int] = asyncio.Queue()
        wakes = 0
        deliver = box._deliver

        def counted() -> None:
            nonlocal wakes
            wakes += 1
            deliver()

        box._deliver = counted  # type: ignore[method-assign]

        def engine() -> None:
            for i in range(100):
                box.put(a if i % 3 else b, i)

        thread = threading.Thread(target=engine)
        thread.start()
        got_a = [await a.get() for _ in range(66)]
        got_b = [await b.get() for _ in range(34)]
        thread.join()
        return got_a, got_b, wakes

    got_a, got_b, wakes = asyncio.run(main())
    assert got_a == [i for i in range(100) if i % 3]
    assert got_b == [i for i in range(100) if not i % 3]
    assert 1 <= wakes <= 100


def test_host_round_bench_runs() -> None:
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-m", "bench.experiments.host_round", "--smoke", "--streams", "1", "2"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "1 stream(s): lanes" in out.stdout and "2 stream(s): lanes" in out.stdout


@pytest.mark.parametrize("rows_each", [1, 3])
def test_graph_inputs_filled_in_place_equal_the_columns_written_whole(rows_each: int) -> None:
    """GraphRunner._fill keeps page tables and padding from round to round; what it copies is
    what writing every stream's rows and columns whole would copy, as streams come and go and
    take pages: decode rounds (one row a stream) and verify passes of three rows a stream."""
    import random

    import torch

    from tensorfold.engine.cuda_graphs import GraphRunner, _Graph
    from tensorfold.family.forward_pass import StreamRows
    from tensorfold.memory.kv_pool import KVPool

    runner = object.__new__(GraphRunner)
    runner.pool = KVPool(40, 4)
    runner.scratch_page, runner.scratch_slot, runner.max_pages, runner._copied = 40, 8, 7, None
    bucket, r = 8, rows_each
    host = torch.empty(3 * bucket * r + (2 + runner.max_pages) * bucket, dtype=torch.int64)
    g = _Graph(bucket, r, None, host, host.clone(), np=host.numpy())  # type: ignore[arg-type]
    runner._pad(g, 0)
    g.width = bucket
    g.dev.copy_(g.host)
    rng = random.Random(0)
    pages = {slot: [rng.randrange(40)] for slot in range(8)}
    pos = {slot: rng.randrange(4) for slot in range(8)}
    for _ in range(200):
        live = sorted(rng.sample(range(8), rng.randint(5, 8)))
        streams = []
        for slot in live:
            pos[slot] = (pos[slot] + r) % 20
            if pos[slot] < r:
                pages[slot] = [rng.randrange(40)]
            while len(pages[slot]) * 4 < pos[slot] + r:
                pages[slot].append(rng.randrange(40))
            tokens = [rng.randrange(100) for _ in range(r)]
            streams.append(StreamRows(slot, pos[slot], tokens, pages[slot]))
        need = max(len(s.pages) for s in streams)
        runner._fill(g, streams, need)
        per_row = torch.zeros(3, bucket, r, dtype=torch.int64)
        per_stream = torch.full((2 + need, bucket), 40, dtype=torch.int64)
        per_stream[0], per_stream[1] = 8, 0  # padding: the scratch slot, fresh
        per_row[1] = torch.arange(r)
        per_row[2] = 40 * 4 + torch.arange(r)
        for i, s in enumerate(streams):
            ps = list(range(s.start, s.end))
            per_row[:, i] = torch.tensor(
                [list(s.tokens), ps, [s.pages[p // 4] * 4 + p % 4 for p in ps]]
            )
            per_stream[:, i] = torch.tensor(
                [s.slot, s.start, *s.pages, *[40] * (need - len(s.pages))]
            )
        want = torch.cat([per_row.reshape(-1), per_stream.reshape(-1)])
        assert torch.equal(g.dev[: want.shape[0]], want)
