"""The checkpoint's tokenizer (tokenizer.json through the `tokenizers` library) and streaming
detokenization."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer

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
        self._special_ids: dict[frozenset[str], frozenset[int]] = {}

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
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        eos_ids = (
            _ids(gc.get("eos_token_id")) + _ids(cfg.get("eos_token_id"))
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

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
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

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and the character span of `text` each token covers. Offsets come from a copy with no
        post-processor, whose offset trimming (ByteLevel trim_offsets) would hide whitespace."""
        if self._offsets_tok is None:
            copy = _HFTokenizer.from_str(self.hf.to_str())
            copy.post_processor = None
            self._offsets_tok = copy
        enc = self._offsets_tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]  # type: ignore[misc]

    def incremental_decoder(self, skip_special_tokens: bool = True,
                            keep: frozenset[int] = frozenset()) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens, keep=keep)


class IncrementalDecoder:
    """Turns a growing list of ids into newly complete text, for streaming.

    Each step decodes a short window (the ids since the last emitted piece, plus the ids of that
    piece as context, so decoders that strip a leading space see the same neighbours) and emits
    what it adds. Text ending in U+FFFD (a UTF-8 sequence split across byte-level tokens) is held
    back until more ids complete it; `flush()` gives out whatever is still held.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()) -> None:
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
