"""Shared by the families' demo-checkpoint builders: an atomic folder build, a checkpoint's files
written the same way every time, and a byte-level BPE tokenizer trained deterministically."""

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


def tokenizer_config(
    eos: str, pad: str, max_length: int, *, bos: str | None = None, **more: Any
) -> dict[str, Any]:
    """tokenizer_config.json for a `PreTrainedTokenizerFast` that leaves spaces as they are, with
    `more` entries; with `bos`, plain encoding starts with it (and adds no `eos`)."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    if bos is not None:
        config.update(bos_token=bos, add_bos_token=True, add_eos_token=False)
    return {**config, **more}


def write_checkpoint(
    folder: Path,
    tok: "Tokenizer",
    weights: dict[str, Any],
    config: dict[str, Any],
    generation_config: dict[str, Any],
    tokenizer_config: dict[str, Any],
) -> None:
    """Write a checkpoint into `folder`: tokenizer.json (`tok`), model.safetensors (`weights`),
    and config.json, generation_config.json and tokenizer_config.json by `write_json`."""
    from safetensors.torch import save_file

    tok.save(str(folder / "tokenizer.json"))
    write_json(folder / "config.json", config)
    write_json(folder / "generation_config.json", generation_config)
    write_json(folder / "tokenizer_config.json", tokenizer_config)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


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
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    return tok


def with_bos(tok: "Tokenizer", bos: str) -> "Tokenizer":
    """`tok` with a post-processor that starts plain encoding (each text of a pair) with the
    special token `bos`."""
    from tokenizers import processors

    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    return tok


# -- trained demo weights, shipped with a plugin (see tensorfold.family.demo_train) ------------------


def tokenizer_digest(tok: "Tokenizer") -> str:
    """What trained weights were trained with: the tokenizer's vocabulary (its merges follow
    from it), in a form no `tokenizers` version changes."""
    import hashlib

    vocab = sorted(tok.get_vocab(with_added_tokens=True).items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def save_trained(weights: dict[str, Any], path: Path, tok: "Tokenizer", trained_by: str) -> None:
    from safetensors.torch import save_file

    save_file(
        weights,
        str(path),
        metadata={
            "format": "pt",
            "tokenizer_sha256": tokenizer_digest(tok),
            "trained_by": trained_by,
        },
    )


def shapes_of(weights: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, by name: what `load_trained` checks shipped weights against."""
    return {k: tuple(v.shape) for k, v in weights.items()}


def load_trained(
    path: Path, shapes: dict[str, tuple[int, ...]], tok: "Tokenizer", retrain: str
) -> dict[str, Any]:
    """The shipped weights at `path` in float32, checked against the names and shapes the demo's
    config gives and the tokenizer they were trained with; `retrain` says how to make new ones."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        trained_with = (f.metadata() or {}).get("tokenizer_sha256")
        weights = {k: f.get_tensor(k).float() for k in f.keys()}
    if trained_with != tokenizer_digest(tok):
        raise RuntimeError(f"{path.name} was trained with another tokenizer; retrain: {retrain}")
    if shapes_of(weights) != shapes:
        raise RuntimeError(f"{path.name} does not match the demo's config; retrain: {retrain}")
    return weights
