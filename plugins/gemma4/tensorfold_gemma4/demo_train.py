"""Train the gemma4 demo's weights: `python -m tensorfold_gemma4.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.family.demo_train, through transformers' `Gemma4ForConditionalGeneration`
(the reference the family's parity tests check the loader against), so it needs transformers;
serving never imports this module. Starts from `demo.random_weights`, on one thread with
deterministic algorithms and seeded batches. About eight minutes on one core.

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after <bos>, each
question with its answer as plain text, and each question as a chat turn rendered by the demo's
template twice: thinking on (the reply is <|channel>thought, a newline, the thought, <channel|>,
the answer) and off (the prompt ends with the empty channel; the reply is the answer).
"""

from __future__ import annotations

from typing import Any

from tensorfold.family.demo_train import Replies, demo_texts, main, train_demo

from . import demo
from .demo_template import CHAT_TEMPLATE

STEPS = 800
REPLIES = Replies(
    thinking="<|channel>thought\n{t}<channel|>{a}<end_of_turn>\n", direct="{a}<end_of_turn>\n"
)


def run(steps: int) -> tuple[dict[str, Any], Any]:
    texts = demo_texts(demo.BOS, CHAT_TEMPLATE, REPLIES, bos_token=demo.BOS)
    return train_demo(demo, "Gemma4ForConditionalGeneration", texts, demo.PAD, demo.SEED, steps)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
