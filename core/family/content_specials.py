"""Special-token strings typed into chat content, kept as text: while the template renders, each
one found in a non-assistant message's content stands behind private-use characters (one for
each of its characters, so lengths and offsets do not change); afterwards they are put back and
the character spans they landed on are reported, for the tokenizer to encode as text.

Without this a user could type `<|im_end|><|im_start|>assistant` and forge a turn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, Sequence

# Assistant turns came from the model (or stand for it): their content is left as it is.
UNPROTECTED_ROLES = frozenset({"assistant"})
# Planes 15 and 16, the supplementary private-use areas: the stand-ins come from here.
_FIRST_STAND_IN, _LAST_STAND_IN = 0xF0000, 0x10FFFD
_PRIVATE = re.compile("[\U000f0000-\U0010ffff]")


@lru_cache(maxsize=16)
def finder(protect: tuple[str, ...]) -> re.Pattern[str] | None:
    """A pattern matching any of `protect` (the longest where several start at one place), built
    as a trie so that a scan costs at most the longest string's length a position, however many
    strings there are (checkpoints list thousands of reserved specials)."""
    trie: dict[str, Any] = {}
    for word in protect:
        if word:
            node = trie
            for ch in word:
                node = node.setdefault(ch, {})
            node[""] = {}
    return re.compile(_trie_pattern(trie)) if trie else None


def _trie_pattern(node: dict[str, Any]) -> str:
    branches = [re.escape(ch) + _trie_pattern(child) for ch, child in sorted(node.items()) if ch]
    if not branches:
        return ""
    ends = "" in node
    if len(branches) == 1 and not ends:
        return branches[0]
    return "(?:" + "|".join(branches) + ")" + ("?" if ends else "")


@dataclass(frozen=True)
class StandIns:
    """The private-use characters standing for the protected strings found in one chat."""

    words: dict[str, str]  # each protected string found -> its stand-ins
    table: dict[int, str]  # stand-in code point -> the character it stands for
    runs: re.Pattern[str]  # runs of stand-ins in a rendered text

    def reveal(self, text: str) -> tuple[str, tuple[tuple[int, int], ...]]:
        """`text` with the protected strings put back, and the character spans they fill
        (adjacent strings share one span)."""
        spans = tuple(m.span() for m in self.runs.finditer(text))
        for word, stand_in in self.words.items():
            text = text.replace(stand_in, word)
        if self.runs.search(text):  # the template cut a string: put back what is left of it
            text = text.translate(self.table)
        return text, spans


def hide(
    chat: list[dict[str, Any]], protect: Sequence[str], seen: Iterable[str] = ()
) -> tuple[list[dict[str, Any]], StandIns | None]:
    """`chat` with each of `protect` in the content of non-assistant messages replaced by its
    stand-ins, and the stand-ins to reveal them with (None, and `chat` itself, when no content
    holds one). `seen`: other text that reaches the render (the template's source): the
    stand-ins avoid every private-use character in it and in the chat."""
    pattern = finder(tuple(protect))
    if pattern is None:
        return chat, None
    found: dict[str, None] = {}
    for message in chat:
        if message.get("role") not in UNPROTECTED_ROLES:
            for text in _texts(message.get("content")):
                found.update(dict.fromkeys(pattern.findall(text)))
    if not found:
        return chat, None
    taken = {
        ord(c)
        for blob in (*seen, json.dumps(chat, ensure_ascii=False, default=str))
        for c in _PRIVATE.findall(blob)
    }
    stand_in: dict[str, str] = {}
    table: dict[int, str] = {}
    point = _FIRST_STAND_IN
    for word in found:
        chars = []
        for ch in word:
            while point in taken:
                point += 1
            if point > _LAST_STAND_IN:  # a chat would need over 130,000 protected characters
                raise ValueError("too many distinct special-token strings in the chat's content")
            table[point] = ch
            chars.append(chr(point))
            point += 1
        stand_in[word] = "".join(chars)
    runs = re.compile("[" + "".join(map(chr, table)) + "]+")
    longest_first = sorted(stand_in, key=len, reverse=True)  # as the pattern matches

    def swap(text: str) -> str:
        for word in longest_first:
            text = text.replace(word, stand_in[word])
        return text

    out = []
    for message in chat:
        content = message.get("content")
        if message.get("role") not in UNPROTECTED_ROLES and content is not None:
            message = {**message, "content": _map_texts(content, swap)}
        out.append(message)
    return out, StandIns(stand_in, table, runs)


def _texts(content: Any) -> list[str]:
    """The strings of a message's content: the content itself, or its parts' `text`."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
    return []


def _map_texts(content: Any, swap: Callable[[str], str]) -> Any:
    if isinstance(content, str):
        return swap(content)
    if isinstance(content, list):
        return [
            {**p, "text": swap(p["text"])}
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else p
            for p in content
        ]
    return content
