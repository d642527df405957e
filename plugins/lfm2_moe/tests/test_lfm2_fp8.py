"""lfm2_moe with fp8 weights (docs/fp8.md): each FP8 format against transformers on the same
weights dequantized (fp32, within 1e-4), and `--quantization fp8` of a bf16 checkpoint equal,
bit for bit, to the same weights written as an FP8 checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from tensorfold import testing
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.ops.fp8 import Fp8Weight
from tensorfold.testing import rel_err
from tensorfold_lfm2_moe.model import load
from tensorfold_lfm2_moe.plugin import LFM2_MOE

if TYPE_CHECKING:
    pass

TOL = 1e-4
PROMPT = 48  # a few rows: the fp32 products are the parity tests' own


def logits(model: object, prompt: list[int]) -> torch.Tensor:
    case = testing.ReferenceCase("fp8", Path("."), None, model, prompt)
    return case.prompt_logits()


@pytest.mark.parametrize("fmt", testing.FP8_FORMATS)
def test_fp8_checkpoint_matches_reference_on_its_weights(
    fmt: str, tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import Lfm2MoeForCausalLM

    fp8, dequantized = testing.write_fp8_checkpoints(
        tiny_paths["lfm2_tiny"], tmp_path, LFM2_MOE.fp8_linears, fmt
    )
    ckpt = Checkpoint.open(fp8)
    model = load(ckpt, "cpu", "float32")
    layer = model.weights.layers[1]  # attention + MoE
    assert isinstance(layer.mixer.qkv, Fp8Weight) and isinstance(layer.ffn.w1, Fp8Weight)
    assert not isinstance(model.weights.layers[1].ffn.gate, Fp8Weight)  # the router stays
    ref = Lfm2MoeForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    prompt = torch.randint(3, 256, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([prompt])).logits[0].float()
    assert rel_err(logits(model, prompt), want) < TOL


def test_quantized_at_load_equals_the_fp8_checkpoint(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    bf16 = testing.write_bf16_checkpoint(tiny_paths["attn_first"], tmp_path / "bf16")
    fp8, _ = testing.write_fp8_checkpoints(bf16, tmp_path, LFM2_MOE.fp8_linears, "block")
    quantized, ckpt = testing.load_quantized(load, bf16, LFM2_MOE.fp8_linears)
    testing.assert_quantizes_what_it_declares(ckpt, LFM2_MOE.fp8_linears)
    stored = load(Checkpoint.open(fp8), "cpu", "float32")
    a, b = quantized.weights.layers[0].mixer.qkv, stored.weights.layers[0].mixer.qkv
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)
    prompt = list(range(3, 3 + PROMPT))
    assert torch.equal(logits(quantized, prompt), logits(stored, prompt))


def test_plan_counts_fp8_bytes(tiny_paths: dict[str, Path], tmp_path: Path) -> None:
    bf16 = testing.write_bf16_checkpoint(tiny_paths["lfm2_tiny"], tmp_path / "bf16")
    ckpt = Checkpoint.open(bf16)
    before = ckpt.local_bytes()
    ckpt.set_quantization(LFM2_MOE.fp8_linears)
    fp8, _ = testing.write_fp8_checkpoints(bf16, tmp_path, LFM2_MOE.fp8_linears, "block")
    assert ckpt.local_bytes() == Checkpoint.open(fp8).local_bytes() < before
