"""A byte-level BPE tokenizer at LFM2's vocabulary size (65536), learnt here with no download, for
benchmarks whose cost grows with the vocabulary (bench/experiments/structured_mask.py:
llguidance's token mask). It has the lfm2_moe demo's special tokens (ids 0..4), post-processor, tokenizer_config.json
(chat template) and generation_config.json, so a folder holding it serves like the demo's.

    python bench/experiments/big_tokenizer.py OUT_DIR [VOCAB]      (default 65536; about 15 s on 2 cores)

The corpus is text every machine has: the running Python's standard library (.py, .txt, .rst,
.html, .json, .xml, .csv files, sorted by path, about 30 MB), then this repository's .py and .md
files; where that does not reach VOCAB tokens, /usr/share/doc's text files too. The same corpus
gives the same tokenizer; another Python version gives another vocabulary of the same size (the
benchmark cares about its size and its code-like tokens, not about which tokens they are). The
trained file (about 4 MB) is not committed: the benchmark builds it at its start.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from tensorfold.family.demo_build import train_byte_bpe
from tensorfold_lfm2_moe.demo import BOS, SPECIAL_TOKENS, build_demo

VOCAB = 65536
REPO = Path(__file__).resolve().parents[2]
SUFFIXES = (".py", ".txt", ".rst", ".html", ".json", ".xml", ".csv")
DOC_BYTES = 40_000_000  # the /usr/share/doc supplement, at most


def _texts(root: Path, suffixes: tuple[str, ...], skip: tuple[str, ...] = ()) -> list[str]:
    if not root.is_dir():
        return []
    files = sorted(
        p
        for p in root.rglob("*")
        if p.suffix in suffixes and p.is_file() and not set(skip) & set(p.parts)
    )
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def corpus(with_docs: bool = False) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = _texts(stdlib, SUFFIXES, skip=("site-packages", "dist-packages"))
    parts += _texts(REPO, (".py", ".md"), skip=(".git", ".whl", "build", ".venv"))
    if with_docs:
        docs, size = [], 0
        for text in _texts(Path("/usr/share/doc"), ("", ".txt", ".md", ".rst")):
            if size > DOC_BYTES:
                break
            docs.append(text)
            size += len(text)
        parts += docs
    return "".join(parts)


def build_tokenizer(vocab: int = VOCAB):
    """The trained tokenizer (a tokenizers.Tokenizer), as the demo's build_tokenizer makes its
    own: byte-level BPE, the specials first, plain encoding starting with <|startoftext|>."""
    from tokenizers import processors

    tok = train_byte_bpe(corpus(), vocab, SPECIAL_TOKENS)
    if tok.get_vocab_size() < vocab:
        tok = train_byte_bpe(corpus(with_docs=True), vocab, SPECIAL_TOKENS)
    if tok.get_vocab_size() < vocab:
        print(
            f"big_tokenizer: the corpus gave {tok.get_vocab_size()} tokens, not {vocab}",
            file=sys.stderr,
        )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def main(out: Path, vocab: int = VOCAB) -> int:
    """Write tokenizer.json (trained), tokenizer_config.json and generation_config.json (the
    demo's) into `out`; returns the vocabulary size."""
    start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    demo = build_demo(Path(tempfile.mkdtemp(prefix="tf-demo-")))
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, out / name)
    size = tok.get_vocab_size()
    print(
        f"big_tokenizer: {size} tokens in {out / 'tokenizer.json'}, "
        f"{time.perf_counter() - start:.1f} s",
        file=sys.stderr,
    )
    return size


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))
