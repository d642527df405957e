"""Train the lfm2_moe demo's weights: `python -m tensorfold_lfm2_moe.demo_train [--steps N]`.

Writes demo_weights.safetensors beside this module (float16; `demo.build_weights` reads it back
as float32). Uses transformers' `Lfm2MoeForCausalLM` (the reference the family's parity tests
check the loader against), so it needs `pip install transformers==5.23.0`; serving never imports
this module. Deterministic on the CPU with one thread: it starts from `demo.random_weights`,
and the batches come from a seeded generator. About four minutes on one core.

What it learns (tensorfold.demo_text): each story paragraph as plain text after <|startoftext|>,
and each question with its answer both as a chat turn (the demo's template) and as plain text.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from tensorfold.demo_text import QA, paragraphs

from . import demo

SEQ = 128  # longest example, in tokens (the stories' paragraphs are below it)


def examples(tok: Any) -> list[list[int]]:
    bos = demo.BOS
    texts = [f"{bos}{p}" for p in paragraphs()]
    texts += [f"{bos}{q} {a}" for q, a in QA]
    texts += [f"{bos}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n"
              for q, a in QA]
    out = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    longest = max(len(ids) for ids in out)
    if longest > SEQ:
        raise SystemExit(f"an example is {longest} tokens, past SEQ={SEQ}")
    return out


def train(steps: int, batch: int = 16, lr: float = 3e-3) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Lfm2MoeForCausalLM

    from tensorfold.demo_build import write_json

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = demo.build_tokenizer()
    ids = {t: tok.token_to_id(t) for t in demo.SPECIAL_TOKENS}
    cfg = demo.config_dict(tok.get_vocab_size(), ids)
    with tempfile.TemporaryDirectory() as start:  # transformers maps the on-disk names
        write_json(Path(start) / "config.json", cfg)
        save_file(demo.random_weights(cfg), str(Path(start) / "model.safetensors"))
        model = Lfm2MoeForCausalLM.from_pretrained(start, dtype=torch.float32)

    data = examples(tok)
    pad = ids[demo.PAD]
    x = torch.full((len(data), SEQ), pad, dtype=torch.long)
    labels = torch.full((len(data), SEQ), -100, dtype=torch.long)
    mask = torch.zeros((len(data), SEQ), dtype=torch.long)
    for i, seq in enumerate(data):
        x[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    labels[:, 0] = -100
    gen = torch.Generator().manual_seed(demo.SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    model.train()
    for step in range(steps):
        pick = torch.randperm(len(data), generator=gen)[:batch]
        width = int(mask[pick].sum(1).max())
        out = model(input_ids=x[pick, :width], attention_mask=mask[pick, :width],
                    labels=labels[pick, :width])
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {out.loss.item():.4f}", flush=True)
    with tempfile.TemporaryDirectory() as end:
        model.save_pretrained(end)
        state = load_file(str(Path(end) / "model.safetensors"))
    weights = {k: v.to(torch.float16).contiguous() for k, v in state.items()}
    return {"weights": weights, "digest": demo.tokenizer_digest(tok)}


def main() -> None:
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps (default 1200)")
    parser.add_argument("--out", type=Path, default=demo.WEIGHTS,
                        help="where the weights go (default: the shipped file)")
    args = parser.parse_args()
    done = train(args.steps)
    save_file(done["weights"], str(args.out),
              metadata={"format": "pt", "tokenizer_sha256": done["digest"],
                        "trained_by": "python -m tensorfold_lfm2_moe.demo_train "
                                      f"--steps {args.steps}"})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
