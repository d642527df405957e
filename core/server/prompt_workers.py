"""Worker processes for the heavy CPU step of a request (prompt_work.make_prompt: the chat
template, the tokenizer, a chat's images), so that neither the event loop nor the engine thread waits on the
GIL for it.

Each worker is a 'spawn'ed process that loads the tokenizer once and then answers one job at a
time over its pipe. A job whose caller stops waiting (its client left, its deadline passed, the
server is stopping) is stopped by killing its worker; a fresh one takes its place. close() kills
them all without waiting for any job.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import tempfile
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from ..config.logs import get_logger
from ..family.tokenizer import Tokenizer
from .image_decode import MediaSource, media_processor
from .prompt_work import Prompt, PromptJob, longest_token_bytes, make_prompt

log = get_logger("tensorfold.prompt_workers")


class WorkersBusy(Exception):
    """No worker came free before the job's deadline."""


class JobTimedOut(Exception):
    """The job ran past its deadline; its worker was killed."""


class WorkerLost(Exception):
    """The worker died during the job (killed from outside, or out of memory)."""


def _serve(conn: Connection, tokenizer_file: str, media: MediaSource | None) -> None:
    """A worker's life: load the tokenizer (and build the family's image processor, when it
    takes images), then answer jobs until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C is the server's to handle
    with open(tokenizer_file, "rb") as f:
        tok: Tokenizer = pickle.load(f)
    if media is not None:
        try:
            media_processor(media)  # built once, here, not in the first image's request
        except Exception:  # the first image request says it (make_prompt builds it again)
            pass
    conn.send_bytes(pickle.dumps(("ready", None)))  # from here it reads a job as it is sent
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the server closed the pipe, or is gone
            return
        try:
            reply: tuple[str, Any] = ("ok", make_prompt(tok, job))
        except Exception as exc:  # the caller decides what the failure means to its client
            reply = ("error", exc)
        # Plain pickle, not the connection's: a prompt's image inputs (tensors) travel as
        # bytes, never as shared memory that lives on with this process.
        try:
            data = pickle.dumps(reply)
        except (pickle.PicklingError, TypeError, AttributeError):  # an exception that won't pickle
            data = pickle.dumps(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}")))
        try:
            conn.send_bytes(data)
        except (BrokenPipeError, OSError):
            return


def _read(conn: Connection) -> tuple[str, Any]:
    reply: tuple[str, Any] = pickle.loads(conn.recv_bytes())
    return reply


class _Worker:
    def __init__(self, ctx: Any, tokenizer_file: str, media: MediaSource | None) -> None:
        self.conn, child = ctx.Pipe()
        self.proc: BaseProcess = ctx.Process(
            target=_serve,
            args=(child, tokenizer_file, media),
            name="tf-prompt-worker",
            daemon=True,
        )
        self.proc.start()
        child.close()
        self.ready = False  # until its first message: a job sent before would fill the pipe

    def kill(self) -> None:
        self.conn.close()
        if self.proc.exitcode is None:
            self.proc.kill()


def _send(worker: _Worker, job: PromptJob) -> None:
    try:
        worker.conn.send(job)  # the worker waits in recv: it reads as this writes
    except OSError:  # BrokenPipeError: it died while idle
        raise WorkerLost(f"the prompt worker (pid {worker.proc.pid}) died") from None


class PromptWorkers:
    """`size` worker processes making prompts; run() hands a job to a free one."""

    def __init__(self, tokenizer: Tokenizer, size: int, media: MediaSource | None = None) -> None:
        """media: the family's image processor's source, for a family that takes images (each
        worker builds the processor as it starts)."""
        self.size = size
        self.started = 0  # workers started, replacements included
        self._tokenizer = tokenizer
        self._media = media
        self._ctx = multiprocessing.get_context("spawn")
        self._file: str | None = None
        self._all: list[_Worker] = []
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._dying: list[BaseProcess] = []

    def start(self) -> None:
        """Start the workers (they load the tokenizer while the server starts)."""
        longest_token_bytes(self._tokenizer)  # computed once, here, not in a request
        fd, self._file = tempfile.mkstemp(prefix="tf-tokenizer-", suffix=".pickle")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(self._tokenizer, f)
        for _ in range(self.size):
            self._idle.put_nowait(self._start_one())

    @property
    def alive(self) -> int:
        """Workers running now (killed ones not yet reaped are not counted)."""
        return sum(1 for w in self._all if w.proc.exitcode is None)

    async def run(self, job: PromptJob, deadline: float) -> Prompt:
        """The job's prompt, made by a free worker by `deadline` (the loop's clock).
        Raises WorkersBusy, JobTimedOut or WorkerLost, or what make_prompt raised; when the
        caller is cancelled, the worker is killed and replaced."""
        try:
            async with asyncio.timeout_at(deadline):
                worker = await self._idle.get()
        except TimeoutError:
            raise WorkersBusy from None
        done = False
        try:
            async with asyncio.timeout_at(deadline):
                if not worker.ready:
                    await self._reply(worker)
                    worker.ready = True
                if job.images is None:
                    _send(worker, job)
                else:  # megabytes of images: written off the loop
                    await asyncio.get_running_loop().run_in_executor(None, _send, worker, job)
                kind, value = await self._reply(worker, large=job.images is not None)
            done = True
        except TimeoutError:
            raise JobTimedOut from None
        finally:
            if done:
                self._idle.put_nowait(worker)
            else:
                self._replace(worker)
        if kind == "error":
            raise value
        return value

    async def _reply(self, worker: _Worker, large: bool = False) -> tuple[str, Any]:
        """The worker's next message, once it starts to come; `large` (a prompt with images,
        whose inputs may be megabytes): read and unpickled off the loop."""
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = worker.conn.fileno()
        loop.add_reader(fd, lambda: None if readable.done() else readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        try:  # the reply is whole or on its way
            if large:
                return await loop.run_in_executor(None, _read, worker.conn)
            return _read(worker.conn)
        except (EOFError, OSError):
            raise WorkerLost(f"the prompt worker (pid {worker.proc.pid}) died") from None

    def _start_one(self) -> _Worker:
        assert self._file is not None, "start() first"
        worker = _Worker(self._ctx, self._file, self._media)
        self._all.append(worker)
        self.started += 1
        return worker

    def _replace(self, worker: _Worker) -> None:
        log.debug("prompt worker stopped mid-job; a fresh one starts", pid=worker.proc.pid)
        worker.kill()
        if worker in self._all:  # not when close() came first
            self._all.remove(worker)
        self._dying = [p for p in (*self._dying, worker.proc) if p.exitcode is None]  # reaps
        if self._file is not None:
            self._idle.put_nowait(self._start_one())

    def close(self) -> None:
        """Kill every worker now, whatever it is doing."""
        for worker in self._all:
            worker.kill()
        for proc in (*self._dying, *(w.proc for w in self._all)):
            proc.join(timeout=1.0)  # killed: a moment at most
        self._all.clear()
        if self._file is not None:
            os.unlink(self._file)
            self._file = None
