"""A request's heavy CPU step: its messages (or a completion's text) -> the prompt's token ids and
the token marks of its turn ends; with images, their pixels decoded and prepared by the family's
processor and their placeholders expanded (image_decode.py). A prompt worker process
(prompt_workers.py) runs it, so it imports the chat template and the tokenizer only (no torch;
the family's image processor imports what it needs, once an image comes).

A prompt of more tokens than the window cannot be served: its ids are not sent back, only their
count, and a rendered chat of more bytes than the window's worst case is not tokenized at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ..family.chat_template import render_chat
from ..family.media import MediaPiece
from ..family.reasoning import ReasoningFormat, starts_inside
from ..family.tokenizer import Tokenizer
from .image_decode import ImageJob, place_images


class PromptTooLong(Exception):
    """The prompt has more bytes than `window` tokens can hold: it was not tokenized."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(size, limit)  # as they are, so that it pickles (a worker raises it)
        self.size = size
        self.limit = limit

    def __str__(self) -> str:
        return f"{self.size} bytes, more than {self.limit}"


@dataclass(frozen=True)
class PromptJob:
    """What a worker makes a prompt of: a chat to render and tokenize, or a completion's text."""

    window: int  # a prompt of this many tokens or more cannot be served
    max_bytes: int  # a prompt text of more bytes cannot fit the window (max_prompt_bytes)
    chat: list[dict[str, Any]] | None = None  # rendered with the tokenizer's chat template
    tools: list[Any] | None = None  # the chat template's `tools`
    text: str | None = None  # a completion's prompt, encoded with the special tokens
    protect: tuple[str, ...] = ()  # render_chat's: special-token strings content keeps literal
    template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    reasoning: ReasoningFormat | None = None  # the family's thinking markup, looked for in the
    # generation prompt (Prompt.thinking)
    add_generation_prompt: bool = True  # a chat ends with the reply's opening (/tokenize: may not)
    add_special_tokens: bool = True  # a text gets the tokenizer's specials (/tokenize: may not)
    cut: bool = False  # a prediction's text: tokens past the window are dropped, not refused
    images: ImageJob | None = None  # the chat's images, one for each {"type": "image"} item


@dataclass(frozen=True)
class Prompt:
    tokens: int  # the prompt's length in tokens
    ids: list[int]  # empty when tokens >= the window: it cannot be served
    marks: tuple[int, ...] = ()  # token positions where a chat's turns end
    thinking: bool = False  # the prompt ends inside a thinking block (ReasoningFormat.opens_in)
    media: tuple[MediaPiece, ...] = ()  # the images' rows in `ids`, in order


@lru_cache(maxsize=4)
def longest_token_bytes(tok: Tokenizer) -> int:
    """An upper bound on the bytes of text one token covers: the longest vocabulary entry in
    UTF-8 (byte-level and metaspace entries spell a byte or a space with more bytes than it
    has), doubled when a normalizer may shorten the text before it is split."""
    vocab = tok.hf.get_vocab(with_added_tokens=True)
    longest = max((utf8_bytes(token) for token in vocab), default=1)
    return max(1, longest) * (2 if tok.hf.normalizer is not None else 1)


def max_prompt_bytes(tok: Tokenizer, window: int) -> int:
    """A prompt text of more bytes than this has more than `window` tokens."""
    return window * longest_token_bytes(tok)


def make_prompt(tok: Tokenizer, job: PromptJob) -> Prompt:
    """The whole step, as a worker runs it: render, check the size, tokenize, place the marks."""
    if job.text is not None:
        _check_size(job.text, job.max_bytes)
        ids = tok.encode(job.text, job.add_special_tokens)
        if job.cut:
            return Prompt(min(len(ids), job.window), ids[: job.window])
        return _bounded(ids, (), job.window)
    assert tok.chat_template is not None and job.chat is not None
    rendered = render_chat(
        tok.chat_template,
        job.chat,
        add_generation_prompt=job.add_generation_prompt,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
        tools=job.tools,
        protect=job.protect,
        **(job.template_kwargs or {}),
    )
    _check_size(rendered.text, job.max_bytes)
    ids, marks = tok.encode_chat(rendered)
    media: tuple[MediaPiece, ...] = ()
    if job.images is not None:
        ids, moved, media = place_images(ids, marks, job.images)
        marks = list(moved)
    thinking = starts_inside(job.reasoning, rendered.text, rendered.marks)
    prompt = _bounded(ids, tuple(marks), job.window)
    return replace(prompt, thinking=thinking, media=media if prompt.ids else ())


def _check_size(text: str, limit: int) -> None:
    if (size := utf8_bytes(text)) > limit:
        raise PromptTooLong(size, limit)


def utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _bounded(ids: list[int], marks: tuple[int, ...], window: int) -> Prompt:
    return Prompt(len(ids), ids if len(ids) < window else [], marks)
