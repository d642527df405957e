"""gemma4 with fp8 weights (docs/fp8.md): each FP8 format against transformers on the same
weights dequantized (fp32, within 1e-4), and `--quantization fp8` of a bf16 checkpoint equal,
bit for bit, to the same weights written as an FP8 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.ops.fp8 import Fp8Weight
from tensorfold_gemma4.demo import build_demo
from tensorfold_gemma4.model import load
from tensorfold_gemma4.plugin import GEMMA4

TOL = 1e-4
PROMPT = list(range(3, 43))  # past e_style's window of 8; the long-prompt parity is test_parity's


@pytest.mark.parametrize("fmt", testing.FP8_FORMATS)
def test_fp8_checkpoint_matches_reference_on_its_weights(
    fmt: str, tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import Gemma4ForConditionalGeneration

    model, err = testing.fp8_parity(
        tiny_paths["e_style"],
        tmp_path,
        GEMMA4.fp8_linears,
        fmt,
        Gemma4ForConditionalGeneration,
        load,
        PROMPT,
    )
    assert err < TOL
    layer = model.weights.layers[0]
    assert isinstance(layer.attention.qkv, Fp8Weight) and isinstance(layer.mlp.down, Fp8Weight)
    assert isinstance(layer.moe.gate_up, Fp8Weight) and layer.moe.gate_up.dim() == 3
    assert not isinstance(layer.moe.router, Fp8Weight) and not isinstance(layer.ple.gate, Fp8Weight)


def test_quantized_at_load_equals_the_fp8_checkpoint(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    testing.assert_quantized_at_load_equals_fp8_checkpoint(
        tiny_paths["causal_lm"], tmp_path, GEMMA4.fp8_linears, load, PROMPT
    )


class TestFp8WeightGates(conformance.Fp8WeightGates):
    family, build_demo = "gemma4", build_demo
    ids, lengths, max_tokens = (13, 700), (9, 200, 600), 6


def test_dummy_weights_quantize_as_loaded(tmp_path: Path) -> None:
    """TF_LOAD_FORMAT=dummy --quantization fp8 (the benchmarks' shapes): fp8 where the loader
    puts it, each layer quantized as it is drawn to the bits of quantizing after."""
    from functools import partial

    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold_gemma4.config import Gemma4Config
    from tensorfold_gemma4.dummy import dummy_weights, load_dummy, quantize_layer

    folder = build_demo(tmp_path)
    testing.assert_dummy_quantizes_as_loaded(load, load_dummy, folder, GEMMA4.fp8_linears)
    cfg = Gemma4Config.from_dict(Checkpoint.open(folder).config)
    draw = partial(dummy_weights, cfg, "cpu", torch.bfloat16, seed=0, std=0.1)
    testing.assert_quantized_as_drawn(draw, quantize_layer)
