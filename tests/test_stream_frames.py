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


def test_graph_inputs_filled_in_place_equal_the_columns_written_whole() -> None:
    """GraphRunner._fill keeps page tables and padding from round to round; what it copies is
    what writing every column whole would copy, as streams come and go and take pages."""
    import random

    import torch

    from tensorfold.engine.cuda_graphs import GraphRunner, _Graph
    from tensorfold.family.forward_pass import StreamRows
    from tensorfold.memory.kv_pool import KVPool

    runner = object.__new__(GraphRunner)
    runner.pool = KVPool(40, 4)
    runner.scratch_page, runner.scratch_slot, runner.max_pages, runner._copied = 40, 8, 6, None
    bucket = 8
    host = torch.empty(4 + runner.max_pages, bucket, dtype=torch.int64)
    runner._pad(host.numpy(), 0, bucket)
    g = _Graph(bucket, None, host, host.clone(), np=host.numpy(), width=bucket)  # type: ignore[arg-type]
    rng = random.Random(0)
    pages = {slot: [rng.randrange(40)] for slot in range(8)}
    pos = {slot: rng.randrange(4) for slot in range(8)}
    for _ in range(200):
        live = sorted(rng.sample(range(8), rng.randint(5, 8)))
        streams = []
        for slot in live:
            pos[slot] = (pos[slot] + 1) % 20
            if pos[slot] == 0:
                pages[slot] = [rng.randrange(40)]
            while len(pages[slot]) * 4 <= pos[slot]:
                pages[slot].append(rng.randrange(40))
            streams.append(StreamRows(slot, pos[slot], [rng.randrange(100)], pages[slot]))
        need = max(len(s.pages) for s in streams)
        runner._fill(g, streams, need)
        want = torch.empty(4 + need, bucket, dtype=torch.int64)
        runner._pad(want.numpy(), 0, bucket)
        for i, s in enumerate(streams):
            col = [
                s.tokens[0],
                s.start,
                s.pages[s.start // 4] * 4 + s.start % 4,
                s.slot,
                *s.pages,
                *[40] * (need - len(s.pages)),
            ]
            want[:, i] = torch.tensor(col)
        assert torch.equal(g.dev[: 4 + need], want)
