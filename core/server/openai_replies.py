"""OpenAI's response shapes: the engine's events in, OpenAI's responses and stream chunks out
(server-sent events), with token texts and logprobs as OpenAI reports them. A chat reply of a
family that thinks has its reasoning split out (`reasoning_content`, streamed before the
content) and counted (`completion_tokens_details.reasoning_tokens`); tool calls are parsed in
the content that follows it."""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import TYPE_CHECKING, Any

from ..engine.requests import Event, Finished, PromptOut, TokenOut
from ..engine.structured import STOPPED
from ..family.reasoning import ReasoningStream, Thought
from ..family.tool_calls import Piece, ToolCallStream, parse_tool_calls
from .openai_api import Parsed, error_body

if TYPE_CHECKING:
    from ..family.tokenizer import Tokenizer

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


_TEXT_SLOT = "\x00tensorfold text\x00"  # where a text chunk's text goes in its frame


def dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def sse(value: Any) -> bytes:
    return b"data: " + (value if isinstance(value, bytes) else dumps(value)) + b"\n\n"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level token uses -> its byte."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class TokenTexts:
    """A token's text and bytes for logprobs (a byte-level token's own bytes, even when it is
    only part of a character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer.hf, "decoder", None)
        self._alphabet = _byte_level_alphabet() if type(decoder).__name__ == "ByteLevel" else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if (hit := self._cache.get(token_id)) is not None:
            return hit
        piece = self.tokenizer.hf.id_to_token(token_id) or ""
        if self._alphabet and all(c in self._alphabet for c in piece):
            raw = bytes(self._alphabet[c] for c in piece)
        else:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        hit = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[token_id] = hit
        return hit


def _token_id(token_id: int) -> tuple[str, list[int]]:
    text = f"token_id:{token_id}"
    return text, list(text.encode())


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def error_status(error: str) -> int:
    """The status of a choice that ended with `error`: 400 for a grammar that failed
    mid-generation (the request asked for more than its budget), 500 for the rest."""
    return 400 if error.startswith(STOPPED) else 500


def _error_event(error: str) -> dict[str, Any]:
    status = error_status(error)
    if status == 400:
        return error_body(400, error, code="grammar_budget_exceeded")
    return error_body(500, f"generation failed: {error}")


class Reply:
    """One choice's answer as it grows, in OpenAI's response, chunk and usage shapes (`Choices`
    holds the n choices of one request)."""

    def __init__(
        self,
        parsed: Parsed,
        model: str,
        seed: int | None,
        texts: TokenTexts,
        index: int = 0,
        id: str | None = None,
    ) -> None:
        self.parsed = parsed
        self.model = model
        self.seed = seed
        self.index = index
        self.texts = texts
        self.token = _token_id if parsed.token_ids else texts
        self.chat = parsed.kind == "chat"
        self.id = id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.text: list[str] = []
        self.entries: list[TokenOut] = []
        self.done: Finished | None = None
        tools = parsed.tools
        self.tool_stream = (
            None
            if tools is None
            else ToolCallStream(tools.format, tools.tools, parallel=tools.parallel)
        )
        self._text_frame: tuple[bytes, bytes] | None = None  # built at the first text chunk
        # a constrained reply is what its grammar allows from the first token: all content
        fmt = parsed.reasoning if self.chat and parsed.params.constraint is None else None
        self.thinking = None if fmt is None else ReasoningStream(fmt, parsed.thinking)
        self.reasoning: list[str] = []  # the reasoning split out so far
        self.content: list[str] = []  # the text after it (tool calls not parsed yet)
        self.reasoning_tokens = 0  # tokens sampled while thinking, markers included
        self._split = Thought()  # split out but not streamed yet
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @functools.cached_property
    def echo_text(self) -> str:
        """The prompt as the reply echoes it (`echo`): its text as sent, or its token ids'
        text, special tokens written out; "" without echo."""
        if not self.parsed.echo:
            return ""
        if self.parsed.prompt_text is not None:
            return self.parsed.prompt_text
        return self.texts.tokenizer.decode(self.parsed.prompt_ids, skip_special_tokens=False)

    def add(self, event: Event) -> None:
        if isinstance(event, PromptOut):  # before any token: the prompt's logprobs (echo)
            self.prompt_logprobs = event.logprobs
            return
        self.text.append(event.text)
        if self.thinking is not None:
            thought = self.thinking.feed(event.text)
            if isinstance(event, Finished):
                thought.extend(self.thinking.finish())
            elif thought.thinking:
                self.reasoning_tokens += 1
            self.reasoning.append(thought.reasoning)
            self.content.append(thought.content)
            self._split.extend(thought)
        if isinstance(event, Finished):
            self.done = event
        elif self.parsed.params.logprobs:
            self.entries.append(event)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH[self.done.reason] if self.done else None

    def _logprobs(self, events: list[TokenOut], offset: int) -> dict[str, Any] | None:
        if not self.parsed.params.logprobs or not events:
            return None
        token = self.token
        if self.chat:
            return {
                "content": [
                    {
                        "token": token(e.token)[0],
                        "logprob": _finite(e.logprob),
                        "bytes": token(e.token)[1],
                        "top_logprobs": [
                            {"token": token(i)[0], "logprob": _finite(lp), "bytes": token(i)[1]}
                            for i, lp in e.top_logprobs
                        ],
                    }
                    for e in events
                ]
            }
        offsets = []
        for e in events:
            offsets.append(offset)
            offset += len(e.text)
        return {
            "tokens": [token(e.token)[0] for e in events],
            "token_logprobs": [_finite(e.logprob) for e in events],
            "top_logprobs": [self._tops(e.top_logprobs, e.token, e.logprob) for e in events],
            "text_offset": offsets,
        }

    def _tops(self, top: list[tuple[int, float]], own: int, logprob: float) -> dict[str, float]:
        """A completions token's top_logprobs: the likeliest ones, and the token itself (so up
        to logprobs + 1 entries, as OpenAI's legacy API reports them)."""
        out = {self.token(i)[0]: _finite(lp) for i, lp in top}
        out.setdefault(self.token(own)[0], _finite(logprob))
        return out

    def _prompt_logprobs(self) -> dict[str, Any] | None:
        """The echoed prompt's tokens in completions' logprobs shape (the first has no
        logprob: `null`), or None when the reply has none. Their text_offset is counted back
        from the echoed text's end, by each token's text (a special token the tokenizer added,
        such as a BOS, is not in a text prompt as sent: it sits at 0)."""
        entries = self.prompt_logprobs
        if not self.parsed.params.logprobs or entries is None:
            return None
        ids = self.parsed.prompt_ids
        ends, end = [], len(self.echo_text)
        for t in reversed(ids):
            end -= len(self.texts(t)[0])
            ends.append(max(end, 0))
        offsets = ends[::-1]
        return {
            "tokens": [self.token(t)[0] for t in ids],
            "token_logprobs": [None] + [_finite(lp) for lp, _ in entries],
            "top_logprobs": [None]
            + [self._tops(top, t, lp) for t, (lp, top) in zip(ids[1:], entries)],
            "text_offset": offsets,
        }

    def usage(self) -> dict[str, Any] | None:
        if (d := self.done) is None:
            return None
        usage: dict[str, Any] = {
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        }
        details: dict[str, int] = {}
        if self.chat and self.parsed.reasoning is not None:
            details["reasoning_tokens"] = self.reasoning_tokens
        if self.parsed.predicted:
            details["accepted_prediction_tokens"] = d.accepted_prediction_tokens
            details["rejected_prediction_tokens"] = d.rejected_prediction_tokens
        if details:
            usage["completion_tokens_details"] = details
        return usage

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + (".chunk" if chunk and self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "seed": self.seed,
        }

    def choice(self) -> dict[str, Any]:
        text = "".join(self.text)
        echo = self.echo_text
        choice: dict[str, Any] = {
            "index": self.index,
            "finish_reason": self.finish_reason,
            "logprobs": self._joined(
                self._prompt_logprobs(), self._logprobs(self.entries, len(echo))
            ),
        }
        if self.chat:
            reasoning = "".join(self.reasoning)
            if self.thinking is not None:  # tool calls are parsed in the text after thinking
                text = "".join(self.content)
            choice["message"] = {"role": "assistant", "content": text}
            if (tools := self.parsed.tools) is not None:
                content, calls = parse_tool_calls(
                    tools.format, text, tools.tools, parallel=tools.parallel, cut=self._cut
                )
                choice["message"] = {
                    "role": "assistant",
                    "content": content if content or not calls else None,
                }
                if calls:
                    choice["message"]["tool_calls"] = [call.message() for call in calls]
                    choice["finish_reason"] = self._tool_finish(calls)
            if reasoning:
                choice["message"]["reasoning_content"] = reasoning
        else:
            choice["text"] = echo + text
            choice["prompt_logprobs"] = None  # vLLM's field (its clients read it): never asked
        return choice

    @staticmethod
    def _joined(
        prompt: dict[str, Any] | None, completion: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Completions' logprobs of the echoed prompt, then of the completion."""
        if prompt is None or completion is None:
            return prompt or completion
        return {name: prompt[name] + completion[name] for name in prompt}

    def echo_sse(self) -> bytes:
        """A streamed reply's first chunk with echo: the prompt's text, and its logprobs when
        asked (send it once they have come: a PromptOut)."""
        body = self.chunk(self.echo_text, [], 0)
        body["choices"][0]["logprobs"] = self._prompt_logprobs()
        return sse(body)

    def response(self) -> dict[str, Any]:
        return {**self.envelope([self.choice()], False), "usage": self.usage()}

    def chunk(
        self,
        text: str,
        events: list[TokenOut],
        offset: int,
        finish: str | None = None,
        first: bool = False,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": self._logprobs(events, offset),
            "finish_reason": finish,
        }
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": text}
                if first
                else ({"content": text} if text or events else {})
            )
        else:
            choice["text"] = text
        body = self.envelope([choice], True)
        if self.parsed.include_usage:
            body["usage"] = None
        return body

    @property
    def _cut(self) -> bool:
        """The reply ended at max_tokens: a tool call section it left open gives the calls it
        completed, and no markup."""
        return self.done is not None and self.done.reason == "length"

    def _tool_finish(self, calls: list[Any]) -> str | None:
        """finish_reason "tool_calls" when the model stopped after calling."""
        reason = self.finish_reason
        return "tool_calls" if calls and reason == "stop" else reason

    def sse_chunks(self, text: str, events: list[TokenOut], offset: int) -> bytes:
        """The stream's events for newly released text (already `add`ed): one chunk, or with
        reasoning split out, its reasoning in a chunk of its own first; with tools parsed, the
        content that is surely not markup, then each tool-call delta in a chunk of its own."""
        if self.thinking is not None:
            return self._thought_chunks(events)
        if self.tool_stream is None:
            if not events and text:
                return self.text_sse(text)
            return sse(self.chunk(text, events, offset))
        return self._tool_chunks(self.tool_stream.feed(text), events)

    def _thought_chunks(self, events: list[TokenOut]) -> bytes:
        """What the reasoning stream has split out since the last call: a `reasoning_content`
        delta (with the tokens' logprobs), then the content as sse_chunks sends it."""
        thought, self._split = self._split, Thought()
        out = b""
        if thought.reasoning:
            body = self.chunk("", events, 0)
            body["choices"][0]["delta"] = {"reasoning_content": thought.reasoning}
            out, events = sse(body), []
        if self.tool_stream is not None:
            return out + self._tool_chunks(self.tool_stream.feed(thought.content), events)
        if thought.content and not events:
            return out + self.text_sse(thought.content)
        if thought.content or events:
            out += sse(self.chunk(thought.content, events, 0))
        return out

    def text_sse(self, text: str) -> bytes:
        """sse(self.chunk(text, [], 0)) for non-empty text, byte for byte, without building and
        encoding the chunk each token: every such chunk of a reply is the same frame around its
        text, so the frame is encoded once and only the text is encoded (as json.dumps would,
        with ensure_ascii off) after that."""
        if self._text_frame is None:
            framed = sse(self.chunk(_TEXT_SLOT, [], 0))
            head, slot, tail = framed.partition(dumps(_TEXT_SLOT))
            assert slot and slot not in tail, "the text slot is in the frame once"
            self._text_frame = (head, tail)
        head, tail = self._text_frame
        return head + encode_basestring(text).encode() + tail

    def _tool_chunks(self, piece: Piece, events: list[TokenOut]) -> bytes:
        out = b""
        if piece.content or events:
            out += sse(self.chunk(piece.content, events, 0))
        for delta in piece.deltas:
            body = self.chunk("", [], 0)
            body["choices"][0]["delta"] = {"tool_calls": [delta]}
            out += sse(body)
        return out

    def finish(self) -> bytes:
        """This choice's last event: its finish chunk (after any held-back tool calls), or the
        error."""
        assert self.done is not None
        if self.done.reason == "error":
            return sse(_error_event(self.done.error or "error"))
        out = self._thought_chunks([]) if self.thinking is not None else b""
        if self.tool_stream is not None:
            out += self._tool_chunks(self.tool_stream.finish(self._cut), [])
            return out + sse(self.chunk("", [], 0, self._tool_finish(self.tool_stream.calls)))
        return out + sse(self.chunk("", [], 0, self.finish_reason))


class Choices:
    """The choices of one request: n of each of its prompts (n = 1 and one prompt for most),
    prompt i's choice j at index i * n + j, as OpenAI orders them; one id, one envelope, and
    usage that counts each prompt once."""

    def __init__(
        self, parsed: Parsed, model: str, seed: int | None, texts: TokenTexts, n: int = 1
    ) -> None:
        prompts = parsed.prompts
        first = Reply(parsed, model, seed, texts)
        self.replies = [first] + [
            Reply(prompts[i // n], model, seed, texts, i, first.id)
            for i in range(1, n * len(prompts))
        ]
        for r in self.replies:
            r.created = first.created
        self.parsed = parsed
        self.chat = first.chat
        self.firsts = self.replies[::n]  # each prompt's first choice

    def __getitem__(self, i: int) -> Reply:
        return self.replies[i]

    @property
    def done(self) -> bool:
        return all(r.done is not None for r in self.replies)

    @property
    def error(self) -> str | None:
        """The first choice's error that ended with one, or None."""
        return next(
            (
                r.done.error or "error"
                for r in self.replies
                if r.done is not None and r.done.reason == "error"
            ),
            None,
        )

    def error_response(self) -> tuple[int, dict[str, Any]]:
        """The status and body of a reply that ended with an error (`error` not None)."""
        error = self.error or "error"
        return error_status(error), _error_event(error)

    def usage(self) -> dict[str, Any] | None:
        if not self.done:
            return None
        first = self.replies[0].usage()
        assert first is not None
        completion = 0
        for r in self.replies:
            assert r.done is not None  # self.done: every reply has finished
            completion += r.done.completion_tokens
        ends = [r.done for r in self.firsts if r.done is not None]
        first["prompt_tokens"] = sum(e.prompt_tokens for e in ends)
        first["prompt_tokens_details"] = {"cached_tokens": sum(e.cached_tokens for e in ends)}
        if details := first.get("completion_tokens_details"):
            ends = [r.done for r in self.replies if r.done is not None]
            sums = {
                "reasoning_tokens": sum(r.reasoning_tokens for r in self.replies),
                "accepted_prediction_tokens": sum(e.accepted_prediction_tokens for e in ends),
                "rejected_prediction_tokens": sum(e.rejected_prediction_tokens for e in ends),
            }
            first["completion_tokens_details"] = {name: sums[name] for name in details}
        return {
            **first,
            "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion,
        }

    def response(self) -> dict[str, Any]:
        first = self.replies[0]
        return {**first.envelope([r.choice() for r in self.replies], False), "usage": self.usage()}

    def ending(self) -> bytes:
        """The stream's last events once every choice has finished: usage, [DONE]."""
        out = b""
        if self.parsed.include_usage:
            out += sse({**self.replies[0].envelope([], True), "usage": self.usage()})
        return out + sse(b"[DONE]")
