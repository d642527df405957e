"""Shared by the families' demo-checkpoint builders: an atomic folder build, JSON files written
the same way every time, and a byte-level BPE tokenizer trained deterministically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def is_complete(folder: Path, files: Iterable[str]) -> bool:
    return all((folder / name).is_file() for name in files)


def build_atomically(
    cache_dir: Path, name: str, files: Sequence[str], write: Callable[[Path], None]
) -> Path:
    """Return `cache_dir / name`, calling `write(folder)` to build it first unless a complete one
    (every one of `files`) is there. The files go into a temporary sibling folder that is
    renamed into place, so a crashed build never leaves a half checkpoint, and concurrent
    builders agree on one result."""
    cache_dir = Path(cache_dir)
    target = cache_dir / name
    if is_complete(target, files):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=cache_dir))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would otherwise stick to the published folder
        write(tmp)
        if target.exists() and not is_complete(target, files):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target, files):  # another builder won the race, or a file is there
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def train_byte_bpe(corpus: str, vocab_size: int, special_tokens: Sequence[str]) -> "Tokenizer":
    """A byte-level BPE trained on `corpus`'s lines; the special tokens take ids 0.. in order.
    The caller sets the post-processor (which special tokens plain encoding adds)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tok
