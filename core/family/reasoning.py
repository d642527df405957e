"""Reasoning: a family's thinking markup in generated text, split into OpenAI's
`reasoning_content` and the `content` that follows, whole or streamed. The core never guesses a
markup: each family names its own with a ReasoningFormat, which its plugin returns from the
`reasoning_format` hook.

ReasoningStream does the splitting for every family:
- a reply starts inside thinking when its prompt does (`ReasoningFormat.opens_in`: the rendered
  prompt's last start marker comes after its last end marker, as GLM's template ends a thinking
  turn's generation prompt with `<think>`); a start marker in the reply opens thinking too (a
  reply that opens with it, as LFM2.5 and Gemma 4 write theirs), and the end marker closes it;
- text arrives in pieces of any size: a suffix that may be the start of a marker is held back,
  so no markup ever reaches either side (a stray end marker outside thinking is dropped too);
- whitespace right after the end marker, and content whitespace right before a start marker,
  is dropped from the content;
- a reply that ends inside thinking (cut by max_tokens, or stopped there) has only reasoning.
Fed the whole text at once it gives the same split as fed piece by piece, so the whole reply
and the stream agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .tool_calls import held_prefix


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's thinking markup.

    name: a short label for logs and docs ("think", "gemma4").
    start / end: the markers that open and close a thinking block, as the family's chat
        template writes them (`<think>` / `</think>`; Gemma 4's `<|channel>thought\\n` /
        `<channel|>`). Where a marker is or holds a special token of the tokenizer, the server
        keeps it in the decoded text so that it reaches the splitter.
    """

    name: str
    start: str
    end: str

    def opens_in(self, prompt: str) -> bool:
        """Whether a reply to `prompt` starts inside thinking: the prompt's last start marker
        comes after its last end marker."""
        start = prompt.rfind(self.start)
        return start >= 0 and start > prompt.rfind(self.end)


def starts_inside(fmt: ReasoningFormat | None, prompt: str, marks: Sequence[int] = ()) -> bool:
    """Whether a reply to a rendered chat `prompt` starts inside thinking: its generation
    prompt (the text after the last message's end, `marks[-1]`) opens a block. A marker that
    a message's content holds does not count."""
    return fmt is not None and fmt.opens_in(prompt[marks[-1] if marks else 0 :])


@dataclass
class Thought:
    """What one step of the stream releases: reasoning text, content text, and whether the
    step's text was thinking (inside a block, or a marker of one): a reasoning token."""

    reasoning: str = ""
    content: str = ""
    thinking: bool = False

    def extend(self, other: Thought) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.thinking = self.thinking or other.thinking


class ReasoningStream:
    """Splits generated text into reasoning and content, incrementally (see the module doc).

    thinking: the reply starts inside thinking (its prompt ends inside a block).
    """

    def __init__(self, fmt: ReasoningFormat, thinking: bool = False) -> None:
        self.fmt = fmt
        self.inside = thinking
        self.thought = thinking  # a block was entered: the reply has reasoning to report
        self._buf = ""  # text not judged yet: a possible marker start
        self._ws = ""  # content whitespace held back: it goes if a start marker follows
        self._after_end = False  # dropping whitespace after an end marker

    def feed(self, text: str) -> Thought:
        out = Thought(thinking=self.inside)
        self._buf += text
        while self._buf:
            if self.inside:
                end = self._buf.find(self.fmt.end)
                if end < 0:
                    cut = len(self._buf) - held_prefix(self._buf, (self.fmt.end,))
                    out.reasoning += self._buf[:cut]
                    self._buf = self._buf[cut:]
                    return out
                out.reasoning += self._buf[:end]
                self._buf = self._buf[end + len(self.fmt.end) :]
                self.inside, self._after_end, out.thinking = False, True, True
                continue
            if self._after_end:
                stripped = self._buf.lstrip()
                if not stripped:
                    self._buf = ""
                    return out
                self._buf, self._after_end = stripped, False
            start, end = self._buf.find(self.fmt.start), self._buf.find(self.fmt.end)
            if end >= 0 and (start < 0 or end < start):  # a stray end marker: markup, dropped
                out.content += self._content(self._buf[:end])
                self._buf = self._buf[end + len(self.fmt.end) :]
                self._after_end, out.thinking = True, True
                continue
            if start >= 0:
                out.content += self._content(self._buf[:start])
                self._ws = ""
                self._buf = self._buf[start + len(self.fmt.start) :]
                self.inside = self.thought = out.thinking = True
                continue
            cut = len(self._buf) - held_prefix(self._buf, (self.fmt.start, self.fmt.end))
            out.content += self._content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return out
        return out

    def finish(self) -> Thought:
        """The end of the text: a held marker start is text after all (reasoning inside a
        block, else content); held whitespace is content."""
        out = Thought(thinking=self.inside)
        if self.inside:
            out.reasoning = self._buf
        elif not self._after_end:
            out.content = self._ws + self._buf
        self._buf = self._ws = ""
        return out

    def _content(self, text: str) -> str:
        """Content, with trailing whitespace held back until something other than a start
        marker follows it."""
        if not text:
            return ""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body) :]
        return body


def split_reasoning(fmt: ReasoningFormat, text: str, thinking: bool = False) -> tuple[str, str]:
    """The whole text at once: its reasoning and its content (markup removed)."""
    stream = ReasoningStream(fmt, thinking)
    out = stream.feed(text)
    out.extend(stream.finish())
    return out.reasoning, out.content
