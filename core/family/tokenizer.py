"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library) and streaming
detokenization."""

from __future__ import annotations

import json
from bisect import bisect_left
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import RenderedChat, marks_to_positions
from .checkpoint import Checkpoint, CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
_REPLACEMENT = "\ufffd"


def _token_text(value: Any) -> str | None:
    """tokenizer_config writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_templates(ckpt: Checkpoint) -> dict[str, str]:
    """Templates by name ("default" first). A chat_template.jinja file wins over tokenizer_config,
    as in transformers."""
    templates: dict[str, str] = {}
    raw = ckpt.tokenizer_config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):  # the older list form: [{"name": ..., "template": ...}]
        for entry in raw:
            if isinstance(entry, dict) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
    jinja = ckpt.path / TEMPLATE_FILE
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    return templates


class Tokenizer:
    """Encode/decode with a checkpoint's tokenizer.json; special tokens from its config files."""

    def __init__(
        self,
        tok: _HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_templates: dict[str, str] | None = None,
    ) -> None:
        self.hf = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_templates = dict(chat_templates or {})
        eos = set(extra_eos_ids)
        if eos_token is not None and (eid := tok.token_to_id(eos_token)) is not None:
            eos.add(eid)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        if bos_token is not None and (bid := tok.token_to_id(bos_token)) is not None:
            bos_token_id = bid
        self.bos_token_id = bos_token_id
        self._offsets_tok: _HFTokenizer | None = None
        self._literal_toks: dict[bool, _HFTokenizer] = {}  # by "the piece starts the text"
        self._special_ids: dict[frozenset[str], frozenset[int]] = {}
        added = tok.get_added_tokens_decoder()
        self._special_content = {i: t.content for i, t in added.items() if t.special}
        self._special_texts = tuple(sorted(set(self._special_content.values())))

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> "Tokenizer":
        path = ckpt.path / TOKENIZER_FILE
        if not path.is_file():
            raise CheckpointError(
                f"{TOKENIZER_FILE} not found in {ckpt.path} (only the fast tokenizer file is read; "
                "tokenizer.model and vocab files are not converted)"
            )
        tok = cls._read(path)
        tc, gc, cfg = ckpt.tokenizer_config, ckpt.generation_config, ckpt.config
        text = cfg.get("text_config")
        text_cfg = text if isinstance(text, dict) else {}
        eos_ids = (
            _ids(gc.get("eos_token_id"))
            + _ids(cfg.get("eos_token_id"))
            + _ids(text_cfg.get("eos_token_id"))
        )
        bos_ids = _ids(gc.get("bos_token_id")) or _ids(cfg.get("bos_token_id"))
        return cls(
            tok,
            bos_token=_token_text(tc.get("bos_token")),
            eos_token=_token_text(tc.get("eos_token")),
            extra_eos_ids=eos_ids,
            bos_token_id=bos_ids[0] if bos_ids else None,
            chat_templates=_chat_templates(ckpt),
        )

    @staticmethod
    def _read(path: Path) -> _HFTokenizer:
        try:
            return _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise CheckpointError(f"{path} cannot be read as a tokenizer: {e}") from None

    @property
    def chat_template(self) -> str | None:
        return self.chat_templates.get("default")

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> str:
        """The text of `ids`; `keep`: special tokens written out even when skipping the others
        (a family's tool-call markers)."""
        if not (skip_special_tokens and keep and not keep.isdisjoint(ids)):
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in keep:
                out += [self.hf.decode(run, skip_special_tokens=True), self.hf.id_to_token(i) or ""]
                run = []
            else:
                run.append(i)
        out.append(self.hf.decode(run, skip_special_tokens=True))
        return "".join(out)

    def special_ids(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those of `texts` that are special tokens of this tokenizer."""
        wanted = frozenset(texts)
        if (hit := self._special_ids.get(wanted)) is None:
            added = self.hf.get_added_tokens_decoder()
            hit = frozenset(i for i, t in added.items() if t.special and t.content in wanted)
            self._special_ids[wanted] = hit
        return hit

    def marker_ids(self, markers: Iterable[str]) -> frozenset[int]:
        """The ids of the special tokens that are, or stand inside, one of `markers` (markup
        such as Gemma 4's `<|channel>thought\n`): what decoding must keep for a parser to see
        the markers."""
        wanted = tuple(markers)
        return self.special_ids(t for t in self._special_texts if any(t in m for m in wanted))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and the character span of `text` each token covers. Offsets come from a copy with no
        post-processor, whose offset trimming (ByteLevel trim_offsets) would hide whitespace."""
        if self._offsets_tok is None:
            copy = _HFTokenizer.from_str(self.hf.to_str())
            copy.post_processor = None
            self._offsets_tok = copy
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]  # type: ignore[misc]

    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special token (added tokens marked special), sorted: what
        render_chat's `protect` keeps literal in a message's content."""
        return self._special_texts

    def encode_chat(self, rendered: RenderedChat) -> tuple[list[int], list[int]]:
        """A rendered chat's ids (as encode(text), without added specials) and its marks as token
        positions (as marks_to_token_positions), from one tokenization. The special-token strings
        in `rendered.literal` are encoded as the text they spell, not as special ids."""
        ids, offsets = self.encode_with_offsets(rendered.text)
        if rendered.literal:
            ids, offsets = self._literal_as_text(rendered.text, ids, offsets, rendered.literal)
        return ids, marks_to_positions(offsets, rendered.marks)

    def _literal_as_text(
        self,
        text: str,
        ids: list[int],
        offsets: list[tuple[int, int]],
        literal: Sequence[tuple[int, int]],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Re-encode, with special tokens read as text, each stretch between two of the
        template's own special tokens that holds a special token from a literal span. The
        tokenizer splits its input at special tokens and encodes the pieces apart, so the
        stretches are cut where it cuts and the rest keeps its ids."""
        starts = [a for a, _ in literal]

        def in_literal(span: tuple[int, int]) -> bool:
            k = bisect_left(starts, span[1]) - 1  # the last literal span starting before its end
            return k >= 0 and literal[k][1] > span[0]

        matched = [k for k, i in enumerate(ids) if self._matched_special(text, i, offsets[k])]
        forged = {k for k in matched if in_literal(offsets[k])}
        if not forged:
            return ids, offsets
        cuts = [k for k in matched if k not in forged]
        out_ids: list[int] = []
        out_offsets: list[tuple[int, int]] = []
        for left, right in zip([-1, *cuts], [*cuts, len(ids)]):
            if left >= 0:
                out_ids.append(ids[left])
                out_offsets.append(offsets[left])
            if forged.isdisjoint(range(left + 1, right)):
                out_ids += ids[left + 1 : right]
                out_offsets += offsets[left + 1 : right]
                continue
            a = offsets[left][1] if left >= 0 else 0
            b = offsets[right][0] if right < len(ids) else len(text)
            enc = self._literal_tok(first=a == 0).encode(text[a:b], add_special_tokens=False)
            out_ids += enc.ids
            out_offsets += [(s + a, e + a) for s, e in enc.offsets]
        return out_ids, out_offsets

    def _matched_special(self, text: str, token: int, span: tuple[int, int]) -> bool:
        """Whether the tokenizer found special token `token` spelt out in text[span] (an unknown
        piece also gets a special id, <unk>, but spells something else)."""
        content = self._special_content.get(token)
        return content is not None and content in text[span[0] : span[1]]

    def _literal_tok(self, *, first: bool) -> _HFTokenizer:
        """A copy that reads special tokens as text (and has no post-processor, as the offsets
        copy). For a piece that does not start the text, Metaspace's prepend_scheme "first"
        becomes "never", as it is for such a piece inside the whole text."""
        if (tok := self._literal_toks.get(first)) is None:
            spec = json.loads(self.hf.to_str())
            spec["post_processor"] = None
            if not first:
                _no_first_prepend(spec)
            tok = _HFTokenizer.from_str(json.dumps(spec))
            tok.encode_special_tokens = True
            self._literal_toks[first] = tok
        return tok

    def incremental_decoder(
        self, skip_special_tokens: bool = True, keep: frozenset[int] = frozenset()
    ) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, keep=keep)


def _no_first_prepend(node: Any) -> None:
    """Set every Metaspace prepend_scheme "first" in a tokenizer.json tree to "never"."""
    if isinstance(node, dict):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
            node["prepend_scheme"] = "never"
        for value in node.values():
            _no_first_prepend(value)
    elif isinstance(node, list):
        for value in node:
            _no_first_prepend(value)


class IncrementalDecoder:
    """Turns a growing list of ids into newly complete text, for streaming.

    Each step decodes a short window (the ids since the last emitted piece, plus the ids of that
    piece as context, so decoders that strip a leading space see the same neighbours) and emits
    what it adds. Text ending in U+FFFD (a UTF-8 sequence split across byte-level tokens) is held
    back until more ids complete it; `flush()` gives out whatever is still held.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._keep = keep
        self.ids: list[int] = []
        self._prefix = 0  # window start: the ids of the last emitted piece begin here
        self._read = 0  # ids before this are emitted
        self.text = ""  # everything emitted so far

    def step(self, new_ids: Iterable[int]) -> str:
        """Append ids; return the text they complete ("" while a character is still partial)."""
        self.ids.extend(new_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self.ids):
            return ""
        decode = self._tok.decode
        before = decode(self.ids[self._prefix : self._read], self._skip, self._keep)
        window = decode(self.ids[self._prefix :], self._skip, self._keep)
        if not final and (window.endswith(_REPLACEMENT) or len(window) <= len(before)):
            return ""
        piece = window[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += piece
        return piece
