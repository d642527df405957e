"""Train the lfm2_moe demo's weights: `python -m tensorfold_lfm2_moe.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32) with tensorfold.family.demo_train, through transformers' `Lfm2MoeForCausalLM` (the
reference the family's parity tests check the loader against), so it needs transformers; serving
never imports this module. Starts from `demo.random_weights`; the tensors come out the same on
every CPU run. About four minutes on one core.

What it learns (tensorfold.family.demo_text): each story paragraph as plain text after <|startoftext|>,
each question with its answer as plain text, and each question as a chat turn rendered by the
demo's template twice: thinking on (the reply is <think>, the thought, </think>, the answer) and
off (the prompt ends <think></think>; the reply is the answer).
"""

from __future__ import annotations

from typing import Any

from tensorfold.family.demo_train import Replies, demo_texts, main, train_demo

from . import demo
from .demo_template import CHAT_TEMPLATE

STEPS = 1200
REPLIES = Replies(thinking="<think>{t}</think>{a}<|im_end|>\n", direct="{a}<|im_end|>\n")


def run(steps: int) -> tuple[dict[str, Any], Any]:
    texts = demo_texts(demo.BOS, CHAT_TEMPLATE, REPLIES, bos_token=demo.BOS)
    return train_demo(demo, "Lfm2MoeForCausalLM", texts, demo.PAD, demo.SEED, steps)


if __name__ == "__main__":
    main(__doc__.splitlines()[0], demo.WEIGHTS, STEPS, run)
