"""What the server's handlers share: the served model, metrics, the draining flag, the open
requests (`State`, the app's `STATE` key), and the mailbox that carries engine events to the
event loop (`Mailbox`). The status page and shutdown use it without the app's routes."""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .image_decode import MediaSource, media_processor
from .metrics import Metrics
from .openai_replies import TokenTexts

if TYPE_CHECKING:
    from ..engine.requests import Request
    from ..engine.start import Served


class Mailbox:
    """Engine events on their way to one event loop: the engine thread drops them here and wakes
    the loop only when no wake-up is already on its way, so a round's events for every stream
    (and a stream's tokens that come faster than the loop reads them) cost one wake-up of the
    loop (call_soon_threadsafe writes to its self-pipe), not one each. Order is kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._woken = False

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:  # on the engine thread
        with self._lock:
            self._items.append((queue, item))
            if self._woken:
                return
            self._woken = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, []
            self._woken = False
        for queue, item in items:
            queue.put_nowait(item)


class State:
    """What the handlers share: the served model, metrics, the draining flag, in-flight count,
    the kinds of media the family takes (its processor is built here, once, at start)."""

    def __init__(self, served: Served, device: str, api_key: str | None) -> None:
        self.served = served
        self.engine = served.engine
        self.metrics = Metrics(served.engine, device, served.plan.lanes)
        self.api_key = api_key.encode() if api_key else None
        self.draining = False
        self.inflight = 0
        self.open: dict[int, Request] = {}  # submitted, not yet answered: abort_all's
        self.idle = asyncio.Event()
        self.idle.set()
        self.texts = TokenTexts(served.tokenizer)
        self._mailbox: Mailbox | None = None
        processor = media_processor(MediaSource.of(served.spec, served.checkpoint))
        # what prompts may hold besides text: the kinds of media the family's processor takes
        self.media_kinds = tuple(sorted(processor.kinds)) if processor is not None else ()

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The mailbox to `loop` (the app's; a new one if the app moved to another loop)."""
        box = self._mailbox
        if box is None or box.loop is not loop:
            box = self._mailbox = Mailbox(loop)
        return box

    def abort_all(self) -> None:
        """Cancel every open request; each ends with finish_reason "abort"."""
        for req in list(self.open.values()):
            self.engine.cancel(req)


STATE: web.AppKey[State] = web.AppKey("state", State)
