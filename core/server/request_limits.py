"""What one request may cost the server: the body's size, how long its headers and body may
take to arrive, how many messages a chat may have and how long a request's preparation may
take, and the bounded pools that turn bodies into requests off the event loop: daemon threads
for the JSON and the fields, worker processes (prompt_workers.py) for the chat template and the
tokenizer. How many connections may be open is connections.py's.

Settings: TF_MAX_BODY_MIB (--max-body-mib), TF_READ_TIMEOUT_S, TF_MAX_MESSAGES,
TF_PREPARE_TIMEOUT_S, TF_PREPARE_WORKERS; a request's images' (media_limits.py).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Callable

from aiohttp import web

from .media_limits import MediaLimits
from .openai_api import ApiError
from .prompt_workers import PromptWorkers

MIB = 1024 * 1024


class DaemonThreads(Executor):
    """A fixed pool of daemon threads: unlike ThreadPoolExecutor's, the process does not wait
    for them at exit, so a stop never waits on a request's work."""

    def __init__(self, size: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        for i in range(size):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        assert not kwargs, "positional arguments only"
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting request
                future.set_exception(exc)


def _workers() -> Executor:
    return DaemonThreads(min(4, os.cpu_count() or 1), "tf-request")


@dataclass
class Limits:
    max_body: int = 8 * MIB  # bytes
    read_timeout_s: float = 30.0  # headers, then the body, each; also an idle connection's life
    max_messages: int = 4096  # a chat's messages
    prepare_timeout_s: float = 30.0  # parse + render + tokenize, once the body is read
    workers: Executor = field(default_factory=_workers)
    prompts: PromptWorkers | None = None  # None: the prompt is made on `workers` (no processes)
    media: MediaLimits = field(default_factory=MediaLimits)  # a request's images

    def handler_args(self) -> dict[str, Any]:
        """aiohttp's per-connection arguments: a connection that sends no complete request
        (headers included) within read_timeout_s of opening, or of its last reply, is closed;
        the unread rest of a refused body is drained for at most as long."""
        return {
            "keepalive_timeout": self.read_timeout_s,
            "lingering_time": min(self.read_timeout_s, 10.0),
        }


LIMITS: web.AppKey[Limits] = web.AppKey("limits", Limits)


async def read_body(request: web.Request) -> bytes:
    """The whole body, or a 413 (before reading it, when Content-Length says it is too big) or
    a 408 (when it does not arrive within read_timeout_s)."""
    limits = request.app[LIMITS]
    length = request.content_length
    if length is not None and length > limits.max_body:
        raise too_large(length, limits.max_body)
    try:
        async with asyncio.timeout(limits.read_timeout_s):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {limits.read_timeout_s:g} s "
            "(TF_READ_TIMEOUT_S); send the whole body its Content-Length promises",
            headers={"Connection": "close"},
        ) from None
    except web.HTTPRequestEntityTooLarge:  # chunked, or a Content-Length that lied
        raise too_large(None, limits.max_body) from None


def too_large(length: int | None, limit: int) -> ApiError:
    size = f"{length} bytes" if length is not None else "more bytes than that"
    return ApiError(
        413,
        f"the request body is {size}; the limit is {limit} bytes "
        f"({limit / MIB:g} MiB: --max-body-mib or TF_MAX_BODY_MIB)",
        headers={"Connection": "close"},
    )  # the unread rest is drained, then closed
