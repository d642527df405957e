"""How `serve` stops, as docs/serving.md promises.

The first SIGINT or SIGTERM stops admission (new requests and /health get 503) and lets the
requests in flight run on for up to --shutdown-timeout seconds. Then, or at once on a second
signal, every request still open is cancelled in the engine: a stream gets a last chunk with
finish_reason "abort" (and its usage chunk when asked) and `data: [DONE]`; a request that is
not streamed gets its partial completion with finish_reason "abort". The handlers have
ABORT_WAIT_S to write that; the aiohttp runner then gets RUNNER_GRACE_S more (it once got
--shutdown-timeout again, twice over, which made a stop hang).

A request still being prepared is not in flight: the runner's cleanup cancels it with its
connection, and serve_cli kills the prompt workers (prompt_workers.py) whatever they are doing;
the request threads are daemons (request_limits.DaemonThreads), so the exit never waits on one.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..config.logs import get_logger

if TYPE_CHECKING:
    from .state import State

ABORT_WAIT_S = 2.0
RUNNER_GRACE_S = 1.0
log = get_logger("tensorfold.serve")


async def drain(state: State, signals: asyncio.Queue[int], timeout: float) -> None:
    """Called once the first signal came and state.draining is set."""
    log.info(
        "shutting down: no new requests; waiting for those in flight (a second signal aborts them)",
        inflight=state.inflight,
        timeout_s=timeout,
    )
    idle = asyncio.ensure_future(state.idle.wait())
    again = asyncio.ensure_future(signals.get())
    try:
        await asyncio.wait([idle, again], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if idle.done():
            return
        why = "a second signal" if again.done() else f"--shutdown-timeout {timeout:g} s"
        log.warning(f"aborting the requests in flight ({why})", inflight=state.inflight)
        state.abort_all()
        await asyncio.wait([idle], timeout=ABORT_WAIT_S)
        if not idle.done():
            log.warning("requests still open after the abort are cut", inflight=state.inflight)
    finally:
        idle.cancel()
        again.cancel()
