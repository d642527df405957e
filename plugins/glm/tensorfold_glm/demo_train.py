"""Train the glm5_next demo's weights: `python -m tensorfold_glm.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.family.demo_train, through transformers' `Glm5NextForConditionalGeneration`
(the reference the family's parity tests check the loader against), so it needs transformers;
serving never imports this module. Starts from demo_weights' random tensors, on one thread with
deterministic algorithms and seeded batches. About eight minutes on one core (transformers' KDA
and mHC run as reference code on the CPU).

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after [gMASK]<sop>,
each question with its answer as plain text, and each question as a chat turn rendered by the
demo's template twice: thinking on (the prompt ends <think>; the reply is the thought, </think>,
the answer) and off (the prompt ends </think>; the reply is the answer), each reply ended by
<|user|>, where GLM stops.
"""

from __future__ import annotations

from typing import Any

from tensorfold.family.demo_train import Replies, demo_texts, main, train_demo

from . import demo
from .demo_text import CHAT_TEMPLATE
from .demo_weights import SEED

STEPS = 400
BATCH = 8
REPLIES = Replies(thinking="{t}</think>{a}<|user|>", direct="{a}<|user|>")


def run(steps: int) -> tuple[dict[str, Any], Any]:
    texts = demo_texts(demo.GMASK + demo.SOP, CHAT_TEMPLATE, REPLIES)
    reference = "Glm5NextForConditionalGeneration"
    return train_demo(demo, reference, texts, demo.ENDOFTEXT, SEED, steps, batch=BATCH)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
