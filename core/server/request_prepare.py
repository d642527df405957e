"""A request's preparation, its body's bytes -> a `Parsed` ready to submit, bounded and
cancellable: the JSON and the fields on the request threads, a chat's images loaded (data: URLs
decoded, allowed URLs fetched: image_load.py), then the prompt (the chat template, the
tokenizer, the images' pixels: prompt_work.make_prompt) on a prompt worker process, all within
TF_PREPARE_TIMEOUT_S of the body's arrival.

When the client leaves, aiohttp cancels the handler and with it the wait here: the prompt worker
doing the request's work is killed and replaced (prompt_workers.py), so no work outlives its
client.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from aiohttp import web

from ..family.media import MediaRefused
from .audio_decode import load_clips
from .image_decode import ImageJob, MediaSource, refuse_without_audio, refuse_without_tower
from .image_load import check_images, load_images
from .openai_api import (
    ApiError,
    Parsed,
    at_prompt,
    bad,
    parse_chat,
    prompt_refusal,
    with_prompt,
)
from .prompt_work import Prompt, PromptJob, make_prompt
from .prompt_workers import JobTimedOut, WorkerLost, WorkersBusy
from .request_checks import parse_request
from .request_limits import LIMITS, Limits

if TYPE_CHECKING:
    from ..engine.start import Served

RETRY_AFTER_S = "1"
T = TypeVar("T")


async def prepare(
    request: web.Request,
    raw: bytes | dict[str, Any],
    parse: Callable[[dict[str, Any], Served], Parsed],
    served: Served,
) -> Parsed:
    """The request `raw` holds (its bytes, or its JSON already parsed), parsed and with its
    prompt made; a 400 naming the field (or the setting) when it cannot be."""
    limits = request.app[LIMITS]
    deadline = asyncio.get_running_loop().time() + limits.prepare_timeout_s
    param = "messages" if parse is parse_chat else "prompt"
    parsed = await off_loop(
        limits, deadline, param, parse_request, raw, parse, served, limits.max_messages
    )
    if parsed.images or parsed.audio:
        parsed = await with_images(limits, parsed, deadline, served)
    if any(one.job is not None for one in parsed.prompts):  # else prompts of token ids
        each = []
        for i, one in enumerate(parsed.prompts):  # a list's prompts: one job after another
            try:
                each.append(await _with_prompt(limits, one, deadline, served, param))
            except ApiError as exc:
                raise at_prompt(exc, i, len(parsed.prompts)) from None
        parsed = replace(each[0], more=tuple(each[1:]))
    if parsed.prediction_job is not None:
        made = await prompt_of(
            limits, parsed.prediction_job, deadline, served, "prediction", lambda exc: None
        )
        parsed = replace(parsed, prediction=tuple(made.ids), prediction_job=None)
    return parsed


async def with_images(limits: Limits, parsed: Parsed, deadline: float, served: Served) -> Parsed:
    """`parsed` with its images' and audio clips' bytes in its job, for the prompt worker to
    decode: refused (400) when the family takes no images (no audio), or past the media
    limits, before any is loaded."""
    assert parsed.job is not None
    source = MediaSource.of(served.spec, served.checkpoint)
    blobs: list[bytes] = []
    clips: list[bytes] = []
    try:
        # the processor is built once (the first media request), on a request thread
        if parsed.images:
            await off_loop(limits, deadline, "messages", refuse_without_tower, source)
            check_images(parsed.images, limits.media)
        if parsed.audio:
            await off_loop(limits, deadline, "messages", refuse_without_audio, source)
            clips = load_clips(parsed.audio, limits.media)
        async with asyncio.timeout_at(deadline):
            blobs = await load_images(parsed.images, limits.media) if parsed.images else []
    except MediaRefused as exc:
        raise bad(str(exc), exc.param) from None
    except TimeoutError:
        raise _late(limits, "messages") from None
    images = ImageJob(
        tuple(blobs),
        tuple(ref.where for ref in parsed.images),
        source,
        limits.media.max_pixels,
        clips=tuple(clips),
        clip_formats=tuple(ref.format for ref in parsed.audio),
        clip_wheres=tuple(ref.where for ref in parsed.audio),
        max_seconds=limits.media.max_audio_seconds,
    )
    return replace(parsed, job=replace(parsed.job, images=images), images=(), audio=())


async def _with_prompt(
    limits: Limits, parsed: Parsed, deadline: float, served: Served, param: str
) -> Parsed:
    """One prompt's request with its prompt made (when it is text)."""
    if parsed.job is None:
        return parsed
    prompt = await prompt_of(
        limits,
        parsed.job,
        deadline,
        served,
        param,
        lambda exc: prompt_refusal(exc, parsed, served),
    )
    return with_prompt(parsed, prompt, served)


async def off_loop(
    limits: Limits, deadline: float, param: str, fn: Callable[..., T], *args: Any
) -> T:
    """fn(*args) on the request threads by `deadline`; past it, a 400 naming `param`."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout_at(deadline):
            return await loop.run_in_executor(limits.workers, fn, *args)
    except TimeoutError:
        raise _late(limits, param) from None


async def prompt_of(
    limits: Limits,
    job: PromptJob,
    deadline: float,
    served: Served,
    param: str,
    refusal: Callable[[Exception], ApiError | None],
) -> Prompt:
    """The job's prompt, made by a prompt worker by `deadline`; what the job raised is the
    request's fault when `refusal` gives its error, else the server's."""
    try:
        return await _make_prompt(limits, job, deadline, served)
    except WorkersBusy:
        size = limits.prompts.size if limits.prompts is not None else 0
        raise ApiError(
            503,
            f"the server's {size} prompt workers (TF_PREPARE_WORKERS) stayed "
            f"busy for {limits.prepare_timeout_s:g} s (TF_PREPARE_TIMEOUT_S); retry "
            "later",
            headers={"Retry-After": RETRY_AFTER_S},
        ) from None
    except JobTimedOut:
        raise _late(limits, param) from None
    except WorkerLost as exc:
        raise ApiError(500, f"internal error: {exc}") from None
    except Exception as exc:
        if (error := refusal(exc)) is None:
            raise
        raise error from None


async def _make_prompt(limits: Limits, job: PromptJob, deadline: float, served: Served) -> Prompt:
    if limits.prompts is not None:
        return await limits.prompts.run(job, deadline)
    loop = asyncio.get_running_loop()  # no worker processes: on the request threads
    try:
        async with asyncio.timeout_at(deadline):
            return await loop.run_in_executor(limits.workers, make_prompt, served.tokenizer, job)
    except TimeoutError:
        raise JobTimedOut from None


def _late(limits: Limits, param: str) -> ApiError:
    return ApiError(
        400,
        f"preparing the request (its JSON, chat template and tokenizer) took "
        f"more than {limits.prepare_timeout_s:g} s, the limit (TF_PREPARE_TIMEOUT_S); "
        f"send {'a shorter chat' if param == 'messages' else 'a shorter prompt'}",
        param=param,
    )
