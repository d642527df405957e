"""How far `--quantization fp8` moves each trained demo from its model dtype, for docs/fp8.md:
teacher-forced logits over the demos' training text (tensorfold.family.demo_text), the same
model loaded plain and with its FamilySpec.fp8_linears quantized at load, both in `dtype`: the
share of rows whose top-1 token agrees and the largest logit difference (absolute, and over the
largest |logit|). As a yardstick, the same for the plain model in `dtype` against fp32 (the
rounding bf16 alone brings). CPU, a few seconds a family.

python bench/fp8_agreement.py [bfloat16|float32] [ROWS]     (default bfloat16, 512 rows)
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family import resolve
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.family.demo_text import plain_text
from tensorfold.family.plugins import get_plugin_manager
from tensorfold.family.tokenizer import Tokenizer


def prompt_logits(model, prompt: list[int]) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=4, num_slots=1, page_rows=512)
    stream = open_stream(runner, 0, len(prompt))
    return runner.run([stream.rows(prompt, logits="all")])[0]


def family_specs() -> dict:
    found: dict = {}
    get_plugin_manager().hook.register_families(register=lambda s: found.setdefault(s.name, s))
    return found


def main(dtype: str = "bfloat16", rows: int = 512) -> None:
    specs = family_specs()
    cache = Path(tempfile.mkdtemp())
    print(
        "| family | dtype | rows | fp8: top-1 agreement | max abs Δ logit | over max abs logit "
        "| yardstick (dtype vs fp32): top-1 | max abs Δ |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in ("lfm2_moe", "gemma4", "glm5_next"):
        spec = specs[name]
        folder = resolve(spec.build_demo)(cache)
        tokens = Tokenizer.from_checkpoint(Checkpoint.open(folder)).encode(plain_text())[:rows]
        plain = resolve(spec.load)(Checkpoint.open(folder), "cpu", dtype)
        quantized_ckpt = Checkpoint.open(folder)
        quantized_ckpt.set_quantization(spec.fp8_linears)
        quantized = resolve(spec.load)(quantized_ckpt, "cpu", dtype)
        fp32 = resolve(spec.load)(Checkpoint.open(folder), "cpu", "float32")
        with torch.no_grad():
            a, b = prompt_logits(plain, tokens), prompt_logits(quantized, tokens)
            c = prompt_logits(fp32, tokens)
        agree, diff = compare(a, b)
        yard_agree, yard_diff = compare(c, a)
        print(
            f"| {name} | {dtype} | {len(tokens)} | {agree:.3f} | {diff:.3f} | "
            f"{diff / a.abs().max().item():.4f} | {yard_agree:.3f} | {yard_diff:.3f} |"
        )


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(share of rows whose top-1 agrees, max |a - b|)."""
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item(), (a - b).abs().max().item()


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["bfloat16"]), *(int(a) for a in sys.argv[2:3]))
