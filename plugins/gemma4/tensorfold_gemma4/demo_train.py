"""Train the gemma4 demo's weights: `python -m tensorfold_gemma4.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.family.demo_train, through transformers' `Gemma4ForConditionalGeneration`
(the reference the family's parity tests check the loader against), so it needs transformers;
serving never imports this module. Starts from `demo.random_weights`, on one thread with
deterministic algorithms and seeded batches. About eight minutes on one core.

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after <bos>, and each
question with its answer both as plain text and as a chat turn (the demo's template).
"""

from __future__ import annotations

from typing import Any

from tensorfold.family.demo_train import demo_texts, main, train_demo

from . import demo

STEPS = 800
CHAT_TURN = "<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n{a}<end_of_turn>\n"


def run(steps: int) -> tuple[dict[str, Any], Any]:
    texts = demo_texts(demo.BOS, CHAT_TURN)
    return train_demo(demo, "Gemma4ForConditionalGeneration", texts, demo.PAD, demo.SEED, steps)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
