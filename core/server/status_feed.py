"""The status page's feed: while at least one page is open, one task asks the engine for a
summary every INTERVAL_S, adds the server's counters and the plan, and hands the same JSON to
every open page. With no page open there is no task and the engine is never asked.

The last HISTORY_S of messages' compact points (pool pages and counters over time) are kept, so
a page opened later draws the recent past it was not there for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ..config.logs import get_logger

if TYPE_CHECKING:
    from .state import State

log = get_logger("tensorfold.status")

INTERVAL_S = 0.5
HISTORY_S = 300.0
ANSWER_TIMEOUT_S = 30.0  # a long prefill pass holds the answer until it ends
QUEUED = 4  # messages a slow page may fall behind before its oldest are dropped


class StatusFeed:
    def __init__(self, state: State) -> None:
        self.state = state
        self.watchers: set[asyncio.Queue[bytes | None]] = set()
        self.history: deque[dict[str, Any]] = deque()
        self.seq = 0
        self._task: asyncio.Task[None] | None = None

    def subscribe(self) -> asyncio.Queue[bytes | None]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUED)
        self.watchers.add(queue)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return queue

    def unsubscribe(self, queue: asyncio.Queue[bytes | None]) -> None:
        self.watchers.discard(queue)

    def history_message(self) -> bytes:
        return json.dumps({"points": list(self.history)}).encode()

    def close(self) -> None:
        """Every open page's stream ends (the server is shutting down)."""
        for queue in list(self.watchers):
            _put(queue, None)
        self.watchers.clear()

    async def _run(self) -> None:
        while self.watchers and not self.state.draining:
            started = time.monotonic()
            summary = await self._ask()
            if summary is not None and self.watchers:
                message = self._message(summary)
                for queue in list(self.watchers):
                    _put(queue, message)
            await asyncio.sleep(max(0.0, INTERVAL_S - (time.monotonic() - started)))
        if self.state.draining:
            self.close()

    async def _ask(self) -> dict[str, Any] | None:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[dict[str, Any] | None] = loop.create_future()

        def reply(summary: dict[str, Any] | None) -> None:  # on the engine thread
            loop.call_soon_threadsafe(_settle, answer, summary)

        self.state.engine.ask_summary(reply)
        try:
            return await asyncio.wait_for(answer, ANSWER_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the engine did not answer the status page", timeout_s=ANSWER_TIMEOUT_S)
            return None

    def _message(self, summary: dict[str, Any]) -> bytes:
        state = self.state
        now = time.time()
        self.seq += 1
        counters = state.metrics.totals()
        counters.update(summary.pop("engine"))
        point = {
            "t": now,
            "pool": {k: summary["pool"][k] for k in ("free", "promised", "live", "store")},
            "host": summary["pool"]["host"],
            "counters": counters,
        }
        self.history.append(point)
        while self.history and self.history[0]["t"] < now - HISTORY_S:
            self.history.popleft()
        summary.update(seq=self.seq, t=now, point=point, counters=counters, inflight=state.inflight)
        return json.dumps(summary).encode()


def _settle(future: asyncio.Future[Any], summary: dict[str, Any] | None) -> None:
    if not future.done():
        future.set_result(summary)


def _put(queue: asyncio.Queue[bytes | None], message: bytes | None) -> None:
    while queue.full():  # a page that does not keep up sees the newest
        with contextlib.suppress(asyncio.QueueEmpty):
            queue.get_nowait()
    queue.put_nowait(message)
