"""Checks of a request body that the field parsers in openai_api.py do not make: text that is
not valid Unicode, the number of chat messages (TF_MAX_MESSAGES), chat roles, logit_bias ids
past the vocabulary.

Each refusal is a 400 naming the field (`param` is the top-level field; the message gives the
path inside it) and what would be accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .openai_api import Parsed, bad, parse_chat, parse_json

if TYPE_CHECKING:
    from ..engine.start import Served

ROLES = ("system", "developer", "user", "assistant", "tool")


def _lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate (U+D800..U+DFFF) in text, or None.

    json.loads turns an unpaired escape such as "\\ud800" into one; it is not Unicode text, and
    the tokenizer and the UTF-8 encoder refuse it."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


def _walk(value: Any, path: str) -> tuple[str, int] | None:
    if isinstance(value, str):
        at = _lone_surrogate(value)
        return None if at is None else (path, at)
    if isinstance(value, dict):
        for key, item in value.items():
            if (at := _lone_surrogate(key)) is not None:
                return (f"{path} (a key)", at)
            if (found := _walk(item, f"{path}.{key}")) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := _walk(item, f"{path}[{i}]")) is not None:
                return found
    return None


def check_text(body: dict[str, Any]) -> None:
    """Refuse a body holding a lone surrogate anywhere, naming the field and the place."""
    for name, value in body.items():
        if (at := _lone_surrogate(name)) is not None:
            raise bad(
                f"the field name {name!r} holds a lone surrogate at character {at}; "
                "text must be valid Unicode (surrogates only in pairs)"
            )
        found = _walk(value, name)
        if found is not None:
            path, index = found
            path = path if len(path) <= 80 else path[:77] + "..."
            raise bad(
                f"{path} holds a lone surrogate (an unpaired \\ud800-\\udfff escape) at "
                f"character {index}; text must be valid Unicode (surrogates only in "
                "high-low pairs)",
                name,
            )


def check_roles(body: dict[str, Any]) -> None:
    """Every chat message's role is one of ROLES (other shapes are refused by parse_chat)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in ROLES:
            raise bad(
                f"messages[{i}].role {role[:40]!r} is not a role; accepted: {', '.join(ROLES)}",
                "messages",
            )


def check_messages(body: dict[str, Any], cap: int) -> None:
    """A chat has at most `cap` messages (each costs the template's work)."""
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > cap:
        raise bad(
            f"messages holds {len(messages)} messages; the limit is {cap} "
            "(TF_MAX_MESSAGES): send fewer, or merge old turns",
            "messages",
        )


def check_logit_bias(parsed: Parsed, vocab: int) -> None:
    """logit_bias keys are token ids of the model's vocabulary."""
    for token, _ in parsed.params.logit_bias:
        if token >= vocab:
            raise bad(
                f"logit_bias key {token} is not a token id: ids are 0..{vocab - 1}", "logit_bias"
            )


def parse_request(
    raw: bytes | dict[str, Any],
    parse: Callable[[dict[str, Any], Served], Parsed],
    served: Served,
    max_messages: int = 4096,
) -> Parsed:
    """The body's bytes (or its JSON, already parsed) -> a validated request: JSON, Unicode,
    roles, the fields, logit_bias. CPU work (JSON, the fields): the server runs it off the event
    loop; the prompt itself (parsed.job: the chat template, the tokenizer) is made after, by a
    prompt worker."""
    body = raw if isinstance(raw, dict) else parse_json(raw)
    if parse is parse_chat:
        check_messages(body, max_messages)
    check_text(body)
    if parse is parse_chat:
        check_roles(body)
    parsed = parse(body, served)
    check_logit_bias(parsed, served.tokenizer.vocab_size)
    return parsed
