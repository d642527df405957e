"""Train the gemma4 demo's weights: `python -m tensorfold_gemma4.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.demo_train, through transformers' `Gemma4ForConditionalGeneration`
(the reference the family's parity tests check the loader against), so it needs transformers;
serving never imports this module. Starts from `demo.random_weights`, on one thread with
deterministic algorithms and seeded batches. About eight minutes on one core.

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after <bos>, and each
question with its answer both as plain text and as a chat turn (the demo's template).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorfold.family.demo_build import write_json
from tensorfold.family.demo_text import QA, paragraphs

from . import demo

STEPS = 800


def texts() -> list[str]:
    bos = demo.BOS
    out = [f"{bos}{p}" for p in paragraphs()]
    out += [f"{bos}{q} {a}" for q, a in QA]
    out += [
        f"{bos}<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n"
        for q, a in QA
    ]
    return out


def run(steps: int) -> tuple[dict[str, Any], Any]:
    from safetensors.torch import save_file
    from transformers import Gemma4ForConditionalGeneration

    from tensorfold.demo_train import train

    tok = demo.build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in demo.SPECIAL_TOKENS}
    cfg = demo.config_dict(tok.get_vocab_size(), ids)

    def write_start(folder: Path) -> None:
        write_json(folder / "config.json", cfg)
        save_file(demo.random_weights(cfg), str(folder / "model.safetensors"))

    examples = [tok.encode(t, add_special_tokens=False).ids for t in texts()]
    return train(
        Gemma4ForConditionalGeneration, write_start, examples, ids[demo.PAD], steps, demo.SEED
    ), tok


if __name__ == "__main__":
    from tensorfold.demo_train import main

    main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
