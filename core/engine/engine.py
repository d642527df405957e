"""The step loop, on its own thread: schedule -> run -> fold back, until stopped.

Requests come in from any thread (the server's event loop, the offline API); events go back
through each request's sink, called on the engine thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

from ..config.logs import get_logger
from ..family.media import MediaPiece
from .lanes import Lanes
from .requests import Event, Finished, Request, RequestRefused
from .sampling import SamplingParams
from .status_snapshot import take_summary

log = get_logger("tensorfold.engine")


class QueueFull(RuntimeError):
    """More requests are waiting than the engine queues; try again later (HTTP 503)."""


class Engine:
    def __init__(self, lanes: Lanes, max_waiting: int = 1024):
        self.lanes = lanes
        self.max_waiting = max_waiting
        self._inbox: list[Request] = []
        self._cancels: set[str] = set()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        # Set when the engine cannot go on (a tensor-parallel rank was lost): why, and who to tell.
        self.fatal: str | None = None
        self.on_fatal: list[Callable[[str], None]] = []
        # Watchers of the status page: each gets one summary, taken between two rounds.
        self._asks: list[Callable[[dict[str, Any] | None], None]] = []

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread = threading.Thread(target=self._loop, name="tensorfold-engine", daemon=True)
        self._thread.start()
        return self

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: Callable[[Event], None],
        marks: Iterable[int] = (),
        prediction: Sequence[int] = (),
        media: Sequence[MediaPiece] = (),
    ) -> Request:
        """Queue a request; raises RequestRefused at once if it can never run here, QueueFull
        when max_waiting requests already wait. prediction: tokens the output is expected to
        repeat (Predicted Outputs), drafted and verified: the tokens are plain decoding's.
        media: the prompt's images (expand_media's pieces), in prompt order; refused (param
        "messages") for a family without a tower, or pieces outside the prompt or
        overlapping."""
        return self.submit_n(prompt, [params], [sink], marks, prediction, media=media)[0]

    def submit_n(
        self,
        prompt: list[int],
        params: Sequence[SamplingParams],
        sinks: Sequence[Callable[[Event], None]],
        marks: Iterable[int] = (),
        prediction: Sequence[int] = (),
        prompt_logprobs: int | None = None,
        media: Sequence[MediaPiece] = (),
    ) -> list[Request]:
        """n choices of one prompt: choice i samples with params[i] (seeded; the same
        max_tokens for all) and reports to sinks[i]. The prompt is computed once and the other
        choices fork from the first. Raises as submit does; RequestRefused with param "n" when
        n choices can never run here together. prompt_logprobs: the prompt tokens' logprobs,
        with that many top ones each, go to every choice (a `PromptOut` before its first
        token). media: as submit's, the prompt's images. Returns the requests, choice 0
        first."""
        group = self._choices(prompt, params, sinks, marks, prediction, prompt_logprobs, media)
        self._queue([group])
        return group

    def submit_prompts(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[Sequence[SamplingParams]],
        sinks: Sequence[Callable[[Event], None]],
        marks: Sequence[Iterable[int]] = (),
        prediction: Sequence[int] = (),
        prompt_logprobs: int | None = None,
        media: Sequence[Sequence[MediaPiece]] = (),
    ) -> list[list[Request]]:
        """Several prompts of one request (OpenAI's list of prompts), each with its n choices
        as submit_n takes them: params[i] are prompt i's choices' params (n of them for every
        prompt), prompt i's choice j reports to sinks[i * n + j], marks[i] are its chat marks
        (none when marks is empty), so each prompt runs as its own submit_n would. Each prompt
        is admitted on its own, in order, as separate requests are (more prompts than lanes
        wait their turn). media[i] are prompt i's images (none when media is empty). Every prompt is checked first and all are queued or none:
        RequestRefused names the prompt's index; QueueFull when max_waiting would be passed.
        Returns each prompt's requests."""
        n = len(params[0]) if params else 0
        if len(params) != len(prompts) or len(sinks) != n * len(prompts) or not prompts:
            raise ValueError(f"{len(sinks)} sinks for {len(prompts)} prompts of {n} choices")
        groups = []
        for i, prompt in enumerate(prompts):
            try:
                groups.append(
                    self._choices(
                        prompt,
                        params[i],
                        sinks[i * n : (i + 1) * n],
                        marks[i] if marks else (),
                        prediction,
                        prompt_logprobs,
                        media[i] if media else (),
                    )
                )
            except RequestRefused as exc:
                where = f"prompt[{i}]: " if len(prompts) > 1 else ""
                raise RequestRefused(where + str(exc), exc.param) from None
        if len(prompts) > 1 and len(prompts) > self.max_waiting:
            raise RequestRefused(
                f"the request holds {len(prompts)} prompts, more than the {self.max_waiting} "
                "requests this server queues (--max-waiting); send fewer prompts a request",
                "prompt",
            )
        self._queue(groups)
        return groups

    def _choices(
        self,
        prompt: list[int],
        params: Sequence[SamplingParams],
        sinks: Sequence[Callable[[Event], None]],
        marks: Iterable[int],
        prediction: Sequence[int],
        prompt_logprobs: int | None,
        media: Sequence[MediaPiece] = (),
    ) -> list[Request]:
        """One prompt's choices as requests, choice 0 holding the others as its forks; checked
        (RequestRefused when they can never run here)."""
        if len(params) != len(sinks) or not params:
            raise ValueError(f"{len(params)} params for {len(sinks)} sinks")
        if len({p.max_tokens for p in params}) > 1:
            raise ValueError("the choices of one prompt share their max_tokens")
        reqs = [
            Request(
                list(prompt),
                p.with_seed(),
                sink,
                marks=tuple(marks),
                prediction=tuple(prediction),
                prompt_logprobs=prompt_logprobs,
                media=tuple(media),
            )
            for p, sink in zip(params, sinks)
        ]
        req = reqs[0]
        req.forks = reqs[1:]
        self.lanes.check(req)
        return reqs

    def _queue(self, groups: list[list[Request]]) -> None:
        """Each group's first request into the inbox, all at once (QueueFull: none)."""
        with self._wake:
            if self._stopping:
                raise QueueFull("the engine is shutting down")
            if (waiting := self.waiting()) + len(groups) > self.max_waiting:
                if len(groups) == 1:
                    raise QueueFull(f"{self.max_waiting} requests are already waiting")
                raise QueueFull(
                    f"{waiting} requests are waiting, and this request's {len(groups)} prompts "
                    f"would pass the {self.max_waiting} the server queues"
                )
            self._inbox.extend(group[0] for group in groups)
            self._wake.notify()

    def cancel(self, req: Request) -> None:
        """The request ends (reason "cancelled") and its lane and pages come back next round."""
        req.cancelled = True
        with self._wake:
            self._wake.notify()

    def ask_summary(self, reply: Callable[[dict[str, Any] | None], None]) -> None:
        """`reply` gets a summary of the lanes, the pool and the prompt store (status_snapshot),
        or None if taking it failed; called once, on the engine thread, between two rounds.
        Nothing is taken unless asked."""
        with self._wake:
            self._asks.append(reply)
            self._wake.notify()

    @property
    def alive(self) -> bool:
        """The engine thread is running (False before start, after stop, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def waiting(self) -> int:
        """Requests submitted and not yet on a lane (a racy read, for admission control)."""
        return len(self._inbox) + len(self.lanes.waiting)

    def busy(self) -> int:
        """Lanes holding a request now, choices waiting to fork included (a racy read, for
        metrics)."""
        return self.lanes.num_lanes - len(self.lanes.free_slots)

    def die(self, reason: str) -> None:
        """Stop for good (any thread): requests in flight and waiting end with `reason` as their
        error, new ones are refused, and every `on_fatal` callback hears why."""
        with self._wake:
            if self.fatal is not None:
                return
            self.fatal = reason
            self._stopping = True
            self._wake.notify()
        log.error("the engine stops", error=reason)
        for callback in self.on_fatal:
            try:
                callback(reason)
            except Exception:  # a listener gone (its event loop closed) changes nothing here
                log.exception("an on_fatal callback failed")

    def stop(self, timeout: float | None = None) -> None:
        """Stop admitting; in-flight requests run to their end, then the loop exits."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[Event]:
        """Submit and yield its events as they come (for the offline API and tools)."""
        events: queue.Queue[Event] = queue.Queue()
        self.submit(prompt, params, events.put)
        while True:
            event = events.get()
            yield event
            if isinstance(event, Finished):
                return

    # -- the engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        lanes = self.lanes
        while True:
            with self._wake:
                while not self._inbox and lanes.idle and not self._stopping and not self._asks:
                    self._wake.wait()
                if self.fatal is not None:
                    break
                inbox, self._inbox = self._inbox, []
                asks, self._asks = self._asks, []
                if self._stopping and not inbox and lanes.idle:
                    self._answer(asks)
                    return
            for req in inbox:
                lanes.add(req)
            self._answer(asks)
            try:
                lanes.step()
            except Exception as exc:  # a failed pass ends its requests; the engine keeps serving
                self.error = exc
                if getattr(exc, "fatal", False):  # ... unless it cannot (a rank was lost)
                    self.die(str(exc))
                    break
                log.exception("pass failed", error=str(exc))
                lanes.fail_all(f"{type(exc).__name__}: {exc}")
                lanes.census()
        with self._wake:
            asks, self._asks = self._asks, []
        self._answer(asks)
        with self._wake:  # requests that came in meanwhile end with the same error
            inbox, self._inbox = self._inbox, []
        lanes.waiting.extend(inbox)
        lanes.fail_all(self.fatal or "the engine stopped")

    def _answer(self, asks: list[Callable[[dict[str, Any] | None], None]]) -> None:
        if not asks:
            return
        try:
            summary = take_summary(self.lanes, len(self._inbox))
        except Exception:  # the page's summary failing must not stop the engine
            log.exception("the status summary failed")
            summary = None
        for reply in asks:
            try:
                reply(summary)
            except Exception:  # a watcher gone (its event loop closed) changes nothing here
                log.exception("a status watcher failed")
