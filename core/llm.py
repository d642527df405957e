"""The offline Python API: `tensorfold.LLM(family=..., model=...).generate(prompts, sampling)`.
Every request goes through the lanes, as the server's do."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union, cast

from .config.logs import get_logger
from .config.settings import Settings
from .engine.choices import choice_params
from .engine.requests import Event, Finished, TokenOut
from .engine.sampling import SamplingParams
from .engine.start import Served, open_served
from .engine.structured import FIELDS
from .family.media import MediaPiece
from .family.reasoning import split_reasoning, starts_inside
from .family.tool_calls import ToolCall, parse_tool_calls

if TYPE_CHECKING:
    from .server.image_decode import ImageJob
    from .server.image_parts import ImageRef

log = get_logger("tensorfold.llm")

Prompt = Union[str, Sequence[int]]


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    seed: int | None = None
    cached_tokens: int = 0
    error: str | None = None
    index: int = 0  # the choice, 0..n-1, when n choices were asked of one prompt
    content: str | None = None  # chat: the text less tool-call markup (None: only calls)
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat with tools: parsed calls
    reasoning_content: str | None = None  # chat: the thinking split out (None: it did not think)
    drafted_tokens: int = 0  # drafts verify rounds checked for it
    accepted_tokens: int = 0  # of them, kept
    accepted_prediction_tokens: int = 0  # of its prediction, kept as drafts
    rejected_prediction_tokens: int = 0  # of its prediction, drafted and refused


class _Collector:
    def __init__(self, completion: Completion, done: threading.Event):
        self.completion = completion
        self.done = done

    def __call__(self, event: Event) -> None:
        c = self.completion
        if isinstance(event, TokenOut):
            c.token_ids.append(event.token)
            c.text += event.text
            c.logprobs.append(event.logprob)
            c.top_logprobs.append(event.top_logprobs)
        elif isinstance(event, Finished):
            c.text += event.text
            c.finish_reason = event.reason
            c.seed = event.seed
            c.cached_tokens = event.cached_tokens
            c.error = event.error
            c.drafted_tokens, c.accepted_tokens = event.drafted_tokens, event.accepted_tokens
            c.accepted_prediction_tokens = event.accepted_prediction_tokens
            c.rejected_prediction_tokens = event.rejected_prediction_tokens
            self.done.set()


class LLM:
    """A served model in this process. Settings come from TF_* variables, overridden by the
    keyword arguments (the same names as Settings' fields: parallel, context, kv_pages, ...)."""

    def __init__(self, family: str | None = None, model: str | Path | None = None, **flags: Any):
        self._open(Settings().with_overrides(**flags), family, model)

    @classmethod
    def from_settings(
        cls, settings: Settings, family: str | None = None, model: str | Path | None = None
    ) -> "LLM":
        llm = cls.__new__(cls)
        llm._open(settings, family, model)
        return llm

    def _open(self, settings: Settings, family: str | None, model: str | Path | None) -> None:
        self.settings = settings
        self.served: Served = open_served(settings, family, model)
        self.tokenizer = self.served.tokenizer
        for line in self.served.start_lines():  # the offline API says them as log lines
            log.info(line)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        n: int = 1,
        *,
        response_format: dict | None = None,
        predictions: Sequence[str | Sequence[int] | None] | None = None,
    ) -> list[Completion]:
        """Run every prompt through the lanes at once; returns completions in prompt order.

        response_format: as the API takes it ({"type": "json_object"} or {"type":
        "json_schema", "json_schema": {"schema": {...}}}), or any one structured-output field
        as {"guided_regex": ...}, {"guided_grammar": ...}, {"structured_outputs": {...}};
        raises ValueError (StructuredError) for what the server would refuse with a 400.

        n > 1: n choices of each prompt, the prompt computed once; choice i (`.index`) samples
        as the prompt alone would with seed `tensorfold.engine.choices.choice_seed(seed, i)` (seed + i;
        each completion's `.seed` is its own). The list holds prompt 0's n choices, then
        prompt 1's, and so on.

        predictions: one a prompt (text or token ids, None for none), what its output is
        expected to repeat (OpenAI's Predicted Outputs): drafted and verified, so the tokens
        are those of a run without it; completions count the accepted and rejected tokens."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast(Prompt, prompts)]
        batch = cast("Sequence[Prompt]", prompts)
        params = (
            sampling
            if isinstance(sampling, Sequence)
            else [sampling or SamplingParams()] * len(batch)
        )
        params = self._constrained(params, response_format)
        if predictions is not None and len(predictions) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(predictions)} predictions")
        ahead = [self._prediction(p) for p in predictions or [None] * len(batch)]
        return self._run([(self.encode(p), (), a, ()) for p, a in zip(batch, ahead)], params, n)

    def _prediction(self, prediction: str | Sequence[int] | None) -> tuple[int, ...]:
        if prediction is None:
            return ()
        if isinstance(prediction, str):
            return tuple(self.tokenizer.encode(prediction, add_special_tokens=False))
        return tuple(int(t) for t in prediction)

    def chat(
        self,
        conversations: Sequence[Sequence[dict]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        n: int = 1,
        *,
        tools: Sequence[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict | None = None,
        chat_template_kwargs: dict | None = None,
        predictions: Sequence[str | Sequence[int] | None] | None = None,
    ) -> list[Completion]:
        """Render each conversation with the checkpoint's chat template (add_generation_prompt)
        and complete it; the turns' ends are marks where the prompt store keeps states.
        n > 1: n choices of each conversation, as in `generate`.

        tools, tool_choice, parallel_tool_calls: as the chat API takes them (see
        docs/serving.md); history may hold assistant `tool_calls` and `role: "tool"` messages.
        With tools offered, each completion's `content` and `tool_calls` are the text parsed in
        the family's tool-call format, and finish_reason is "tool_calls" when it called.
        tool_choice "required" or named is constrained where the family's format can be (the
        arguments then always parse and validate against the tool's parameters).
        response_format: as in `generate`.
        chat_template_kwargs: more variables for the chat template (`enable_thinking`, ...),
        as the chat API takes them; TF_REASONING's default applies where it sets none. Where
        the family thinks, each completion's `reasoning_content` is its thinking, split out of
        `content`.
        predictions: as in `generate`, one a conversation.
        A message's content may hold image_url parts, as the chat API takes them (data: URLs;
        http(s) URLs of hosts TF_ALLOWED_MEDIA_DOMAINS lists), within the TF_MAX_IMAGE*
        limits, for a family that takes images; and input_audio parts (base64 WAV) within the
        TF_MAX_AUDIO_* limits, for a family that takes audio.
        Raises ValueError (ToolRequestError, StructuredError, MediaRefused) for what the
        server would refuse."""
        from .family.chat_template import marks_to_token_positions, render_chat
        from .server.image_decode import place_images
        from .server.openai_api import ApiError, template_kwargs
        from .server.tool_request import parse_tool_request, tool_history

        template = self.tokenizer.chat_template
        if template is None:
            raise ValueError("the checkpoint has no chat template")
        request = parse_tool_request(
            {
                "tools": tools,
                "tool_choice": tool_choice,
                "parallel_tool_calls": parallel_tool_calls,
            },
            self.served.spec.name,
            self.served.tool_format,
        )
        params = (
            sampling
            if isinstance(sampling, Sequence)
            else [sampling or SamplingParams()] * len(conversations)
        )
        try:
            extra = template_kwargs(
                {"chat_template_kwargs": chat_template_kwargs}, self.served.enable_thinking
            )
        except ApiError as exc:
            raise ValueError(exc.message) from None
        reasoning = self.served.reasoning_format
        kept = set(self.tokenizer.special_ids(request.format.markers) if request else ())
        if reasoning is not None:
            kept |= self.tokenizer.marker_ids((reasoning.start, reasoning.end))
        if kept:
            params = [replace(p, keep_special_ids=tuple(sorted(kept))) for p in params]
        params = self._constrained(params, response_format, request)
        if predictions is not None and len(predictions) != len(conversations):
            raise ValueError(
                f"{len(conversations)} conversations but {len(predictions)} predictions"
            )
        ahead = [self._prediction(p) for p in predictions or [None] * len(conversations)]
        runs: list[tuple[list[int], list[int], tuple[int, ...], tuple[MediaPiece, ...]]] = []
        thinking: list[bool | None] = []  # None: the reply is not split (constrained)
        for messages, p, prediction in zip(conversations, params, ahead):
            messages, images = self._images(messages)
            chat = render_chat(
                template,
                tool_history(messages),
                bos_token=self.tokenizer.bos_token,
                eos_token=self.tokenizer.eos_token,
                tools=request.tools if request else None,
                **(extra or {}),
            )
            ids = self.tokenizer.encode(chat.text)
            marks = marks_to_token_positions(self.tokenizer, chat.text, chat.marks)
            media: tuple[MediaPiece, ...] = ()
            if images is not None:
                ids, moved, media = place_images(ids, marks, images)
                marks = list(moved)
            runs.append((ids, marks, prediction, media))
            inside = starts_inside(reasoning, chat.text, chat.marks)
            thinking += [None if p.constraint is not None else inside] * n
        completions = self._run(runs, params, n)
        for c, opens in zip(completions, thinking):
            c.content = c.text
            if reasoning is not None and opens is not None:
                thought, c.content = split_reasoning(reasoning, c.text, opens)
                c.reasoning_content = thought or None
            if request is not None:
                content, c.tool_calls = parse_tool_calls(
                    request.format,
                    c.content,
                    request.tools,
                    parallel=request.parallel,
                    cut=c.finish_reason == "length",
                )
                c.content = content if content or not c.tool_calls else None
                if c.tool_calls and c.finish_reason == "stop":
                    c.finish_reason = "tool_calls"
        return completions

    def _images(self, messages: Sequence[dict]) -> tuple[list[dict], ImageJob | None]:
        """The messages with each content that holds image_url or input_audio parts as the
        chat template reads it (text, image and audio items), and those images and clips
        loaded (data: URLs; http(s) URLs of hosts TF_ALLOWED_MEDIA_DOMAINS lists; base64
        clips), or None when there are none."""
        from .server.audio_decode import load_clips
        from .server.image_decode import (
            ImageJob,
            MediaSource,
            refuse_without_audio,
            refuse_without_tower,
        )
        from .server.image_load import load_images_now
        from .server.image_parts import AudioRef, chat_content
        from .server.media_limits import MediaLimits

        out: list[dict] = []
        refs: list[ImageRef] = []
        heard: list[AudioRef] = []
        for i, message in enumerate(messages):
            content = message.get("content")
            if isinstance(content, list) and any(
                isinstance(part, dict) and part.get("type") in ("image_url", "input_audio")
                for part in content
            ):
                content = chat_content(content, f"messages[{i}]", refs, heard)
                message = {**message, "content": content}
            out.append(message)
        if not refs and not heard:
            return out, None
        source = MediaSource.of(self.served.spec, self.served.checkpoint)
        limits = MediaLimits.from_settings(self.settings)
        blobs: list[bytes] = []
        clips: list[bytes] = []
        if refs:
            refuse_without_tower(source)
            blobs = load_images_now(refs, limits)
        if heard:
            refuse_without_audio(source)
            clips = load_clips(heard, limits)
        return out, ImageJob(
            tuple(blobs),
            tuple(ref.where for ref in refs),
            source,
            limits.max_pixels,
            clips=tuple(clips),
            clip_formats=tuple(ref.format for ref in heard),
            clip_wheres=tuple(ref.where for ref in heard),
            max_seconds=limits.max_audio_seconds,
        )

    def _constrained(self, params, response_format, tools=None) -> list[SamplingParams]:
        from .engine.structured import from_body

        body = dict(response_format or {})
        if body and not set(body) & set(FIELDS):  # the OpenAI shape itself
            body = {"response_format": body}
        constraint = from_body(body, self.tokenizer, tools)
        if constraint is None:
            return list(params)
        return [replace(p, constraint=constraint) for p in params]

    def _run(self, runs, params, n: int = 1) -> list[Completion]:
        if len(params) != len(runs):
            raise ValueError(f"{len(runs)} prompts but {len(params)} sampling params")
        waits = []
        for (ids, marks, prediction, media), p in zip(runs, params):
            choices = [(Completion(ids, index=i), threading.Event()) for i in range(n)]
            sinks = [_Collector(c, done) for c, done in choices]
            self.served.engine.submit_n(
                ids, choice_params(p, n), sinks, marks, prediction, media=media
            )
            waits += choices
        for _, done in waits:
            done.wait()
        return [c for c, _ in waits]

    def close(self) -> None:
        self.served.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
