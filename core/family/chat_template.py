"""Render a checkpoint's chat template in a jinja2 sandbox, as transformers' apply_chat_template
does, and find where each turn ends (the chat marks the prompt store keeps states at).

A chat template is code from the checkpoint: it runs in an ImmutableSandboxedEnvironment, sees
only plain JSON-like data, and any failure or unsafe access becomes a ChatTemplateError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .content_specials import StandIns, hide

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Messages at the end of a chat whose ends are marked: each mark costs a render of the chat up
# to it, so marking every message of a long chat would cost renders quadratic in its length.
MARKED_TAIL = 8


class ChatTemplateError(Exception):
    """The chat template failed to compile or render, refused the messages, or tried an unsafe
    operation."""


@dataclass(frozen=True)
class RenderedChat:
    text: str
    marks: tuple[int, ...]  # character offsets in `text` where a message ends, increasing
    # (start, end) character spans of `text` holding special-token strings that a message's
    # content brought (render_chat's `protect`): to be tokenized as text, not as specials
    literal: tuple[tuple[int, int], ...] = ()


class _Raised(jinja2.TemplateError):
    """What the template's own raise_exception() raises."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant mask): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore names, as transformers' TemplateNamespace does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Namespace's own signature trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"namespace attribute {name!r} starts with '_'")


class _Dict:
    """dict() for templates, without the class itself (and its attributes) in reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        dict=_Dict(),
        namespace=_Namespace,
    )
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        where = f"line {e.lineno}"
        raise ChatTemplateError(f"chat template does not parse ({where}): {e.message}") from None


def _plain(value: Any) -> Any:
    """Rebuild template inputs from JSON types only: rich objects carry methods the sandbox cannot
    judge. Anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (enums, numpy scalars) carry extra methods: strip them to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare(
    messages: Sequence[Any], protect: Sequence[str] = (), seen: Iterable[str] = ()
) -> tuple[list[dict[str, Any]], StandIns | None]:
    """As apply_chat_template: drop None-valued keys, then alias the reasoning fields (a prior
    turn's `reasoning_content`, `reasoning` or `thinking`, under all three names). Then the
    strings of `protect` in non-assistant content go behind stand-ins (content_specials.hide),
    returned to reveal them after the render (None where no content holds one); `seen`: the
    other text the render reads, whose private-use characters the stand-ins avoid."""
    out = []
    for message in messages:
        if hasattr(message, "model_dump"):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            kind = type(message).__name__
            raise ChatTemplateError(f"a chat message must be a mapping, got {kind}")
        m = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:  # under each name a template reads (GLM, Gemma 4, LFM2.5)
            m = {"thinking": reasoning, "reasoning": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if not protect:
        return out, None
    try:
        return hide(out, protect, seen)
    except ValueError as e:
        raise ChatTemplateError(str(e)) from None


def _rendered_inputs(template: str, context: dict[str, Any]) -> Iterator[str]:
    """The template's source and the context's strings, read only when stand-ins are needed."""
    yield template
    yield json.dumps(context, ensure_ascii=False, default=str)


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    try:
        return template.render(**context)
    except _Raised as e:
        raise ChatTemplateError(f"chat template refused the messages: {e.message}") from None
    except jinja2.sandbox.SecurityError as e:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except Exception as e:  # errors from the template's own expressions (TypeError, KeyError, ...)
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None


def render_chat(
    template: str,
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: Sequence[Any] | None = None,
    with_marks: bool = True,
    protect: Sequence[str] = (),
    **extra: Any,
) -> RenderedChat:
    """Render `messages` with `template`, as transformers' apply_chat_template(tokenize=False).

    Marks: the prefixes messages[:1], messages[:2], ... are rendered without the generation
    prompt; where a prefix's text is a prefix of the full text, its length is the mark of that
    message. Templates that render earlier turns differently once later ones follow (e.g. by
    dropping old reasoning), or that refuse a partial chat, give no mark for those messages.
    Marks are strictly increasing and positive, so a message that renders nothing adds none.
    Only the last MARKED_TAIL messages get marks (the turns a next request resumes from), so a
    long chat costs MARKED_TAIL + 1 renders, not one per message; with_marks=False skips them.

    protect: special-token strings to keep literal where the content of a non-assistant message
    holds them (a user typing `<|im_end|>` must not end the turn). The text is the same; their
    spans are in `literal`, for Tokenizer.encode_chat to encode as text.
    """
    if not messages:
        raise ChatTemplateError("cannot render a chat with no messages")
    compiled = compile_template(template)
    context = _plain(extra)
    for key, token in (("bos_token", bos_token), ("eos_token", eos_token)):
        if token is not None:
            context[key] = token
    context["tools"] = _plain(tools) if tools is not None else None
    context.setdefault("documents", None)
    chat, stand_ins = _prepare(messages, protect, _rendered_inputs(template, context))
    text = _render(
        compiled, {**context, "messages": chat, "add_generation_prompt": add_generation_prompt}
    )
    marks: list[int] = []
    first = max(1, len(chat) - MARKED_TAIL + 1)
    for n in range(first, len(chat) + 1 if with_marks else first):
        try:
            prefix = _render(
                compiled, {**context, "messages": chat[:n], "add_generation_prompt": False}
            )
        except ChatTemplateError:
            continue
        last = marks[-1] if marks else 0
        if text.startswith(prefix) and len(prefix) > last:
            marks.append(len(prefix))
    if stand_ins is None:
        return RenderedChat(text, tuple(marks))
    text, literal = stand_ins.reveal(text)  # one character for one: the marks still hold
    return RenderedChat(text, tuple(marks), literal)


def marks_to_token_positions(
    tokenizer: "Tokenizer", text: str, char_marks: Sequence[int]
) -> list[int]:
    """For each character mark in `text`, the number of tokens (of `text` encoded without special
    tokens) that cover exactly text[:mark]. A mark that falls inside a token is dropped."""
    _, offsets = tokenizer.encode_with_offsets(text)
    return marks_to_positions(offsets, char_marks)


def marks_to_positions(offsets: Sequence[tuple[int, int]], char_marks: Sequence[int]) -> list[int]:
    """marks_to_token_positions from the tokens' character spans (`offsets`, in order)."""
    positions: list[int] = []
    i = 0
    for mark in sorted(char_marks):
        # A token belongs before the mark when it ends at or before it (a zero-width token sitting
        # exactly on the mark belongs after it).
        while i < len(offsets):
            start, end = offsets[i]
            if end > mark or (end == mark and start == mark):
                break
            i += 1
        if i < len(offsets) and offsets[i][0] < mark:
            continue  # the mark cuts token i
        if not positions or i > positions[-1]:
            positions.append(i)
    return positions
