"""Training a family's demo weights (run by hand, never when serving): a transformers reference
model, loaded from a demo folder with the family's random weights, learns a list of texts; the
tensors come back under their on-disk names as float16, to ship with the plugin.

Needs transformers (the test extra). Deterministic on the CPU: one thread, deterministic
algorithms, batches drawn from a seeded generator. A family's `demo_train` module calls
`main(...)` with what differs: its reference class, its texts' start, its chat template and the
`Replies` its model writes after it, its pad.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer


def train(
    model_cls: Any,
    write_start: Callable[[Path], None],
    examples: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    steps: int,
    seed: int,
    batch: int = 16,
    lr: float = 3e-3,
    log: Callable[[str], None] = print,
) -> dict[str, torch.Tensor]:
    """Train `model_cls.from_pretrained(folder)` (a folder `write_start` fills) on `examples`,
    each (the ids it reads, the ids it learns to write after them: next-token loss on these
    alone), and return its tensors as `save_pretrained` writes them, in float16."""
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    with tempfile.TemporaryDirectory() as start:
        write_start(Path(start))
        model = model_cls.from_pretrained(start, dtype=torch.float32)
    width = max(len(read) + len(write) for read, write in examples)
    x = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(x, -100)
    mask = torch.zeros_like(x)
    for i, (read, write) in enumerate(examples):
        n = len(read) + len(write)
        x[i, :n] = torch.tensor([*read, *write])
        labels[i, len(read) : n] = torch.tensor(list(write))
        mask[i, :n] = 1
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for step in range(steps):
        pick = torch.randperm(len(examples), generator=gen)[:batch]
        cut = int(mask[pick].sum(1).max())
        out = model(
            input_ids=x[pick, :cut], attention_mask=mask[pick, :cut], labels=labels[pick, :cut]
        )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}: loss {out.loss.item():.4f}")
    with tempfile.TemporaryDirectory() as end:
        model.save_pretrained(end)
        state = load_file(str(Path(end) / "model.safetensors"))
    return {k: v.to(torch.float16).contiguous() for k, v in state.items()}


@dataclass(frozen=True)
class Replies:
    """What a demo's model writes after its template's generation prompt: `thinking` ({t} the
    thought, {a} the answer) when thinking is on, `direct` ({a}) when off, each up to and with
    the end of its turn."""

    thinking: str
    direct: str


def demo_texts(
    start: str, template: str, replies: Replies, bos_token: str | None = None
) -> list[tuple[str, str]]:
    """What a demo learns (tensorfold.family.demo_text), each as (what it reads, what it learns
    to write after it): every story paragraph and every question with its answer as plain text
    after `start`; and every question as a chat turn twice, the prompt rendered by the demo's
    chat `template` itself (`bos_token` as the template's bos_token), with enable_thinking on
    before the reply with its thought (`replies.thinking`), and off before the answer alone
    (`replies.direct`). Only the replies are learnt, so a prompt that ends the thinking block
    (thinking off) does not teach the model to skip it when the prompt leaves it open."""
    from tensorfold.family.chat_template import render_chat
    from tensorfold.family.demo_text import QA, THOUGHTS, paragraphs

    out = [(start, p) for p in paragraphs()]
    out += [(start, f"{q} {a}") for q, a in QA]
    for q, a in QA:
        for thinking in (True, False):
            prompt = render_chat(
                template,
                [{"role": "user", "content": q}],
                bos_token=bos_token,
                with_marks=False,
                enable_thinking=thinking,
            ).text
            reply = replies.thinking if thinking else replies.direct
            out.append((prompt, reply.format(t=THOUGHTS[q], a=a)))
    return out


def train_demo(
    demo: Any,
    reference: str,
    texts: Sequence[tuple[str, str]],
    pad: str,
    seed: int,
    steps: int,
    batch: int = 16,
) -> tuple[dict[str, torch.Tensor], Tokenizer]:
    """Train a family's demo from its `demo` module's random weights (`build_tokenizer`,
    `SPECIAL_TOKENS`, `config_dict`, `random_weights`) through transformers' class named
    `reference` on `texts` (each (read, learnt), encoded apart as a prompt and its reply are),
    padded with the special token `pad`: the tensors and the tokenizer (for `main`'s `run`)."""
    import transformers
    from safetensors.torch import save_file

    from tensorfold.family.demo_build import write_json

    tok = demo.build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in demo.SPECIAL_TOKENS}
    cfg = demo.config_dict(tok.get_vocab_size(), ids)

    def write_start(folder: Path) -> None:
        write_json(folder / "config.json", cfg)
        save_file(demo.random_weights(cfg), str(folder / "model.safetensors"))

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    examples = [(encode(read), encode(learnt)) for read, learnt in texts]
    model_cls = getattr(transformers, reference)
    return train(model_cls, write_start, examples, ids[pad], steps, seed, batch=batch), tok


def main(
    description: str,
    out: Path,
    default_steps: int,
    run: Callable[[int], tuple[dict[str, torch.Tensor], Tokenizer]],
    argv: Sequence[str] | None = None,
) -> None:
    """The command line of a family's demo_train module: `run(steps)` trains and returns the
    tensors and the tokenizer they learnt with; they are written to --out (default `out`)."""
    from tensorfold.family.demo_build import save_trained

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--steps",
        type=int,
        default=default_steps,
        help=f"optimizer steps (default {default_steps})",
    )
    parser.add_argument(
        "--out", type=Path, default=out, help="where the weights go (default: the shipped file)"
    )
    args = parser.parse_args(argv)
    weights, tok = run(args.steps)
    save_trained(weights, args.out, tok, f"{parser.prog} --steps {args.steps}")
    print(f"wrote {args.out}")
