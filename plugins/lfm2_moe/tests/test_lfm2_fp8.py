"""lfm2_moe with fp8 weights (docs/fp8.md): each FP8 format against transformers on the same
weights dequantized (fp32, within 1e-4), and `--quantization fp8` of a bf16 checkpoint equal,
bit for bit, to the same weights written as an FP8 checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.family import Shard
from tensorfold.family.checkpoint import Checkpoint
from tensorfold.ops.fp8 import Fp8Weight
from tensorfold_lfm2_moe import shards
from tensorfold_lfm2_moe.config import Lfm2MoeConfig
from tensorfold_lfm2_moe.demo import build_demo
from tensorfold_lfm2_moe.model import load
from tensorfold_lfm2_moe.plugin import LFM2_MOE
from tensorfold_lfm2_moe.weights import load_weights

TOL = 1e-4
PROMPT = list(range(3, 51))  # a few rows: the long-prompt parity is test_parity's


@pytest.mark.parametrize("fmt", testing.FP8_FORMATS)
def test_fp8_checkpoint_matches_reference_on_its_weights(
    fmt: str, tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import Lfm2MoeForCausalLM

    model, err = testing.fp8_parity(
        tiny_paths["lfm2_tiny"],
        tmp_path,
        LFM2_MOE.fp8_linears,
        fmt,
        Lfm2MoeForCausalLM,
        load,
        PROMPT,
    )
    assert err < TOL
    conv, attn = model.weights.layers[0], model.weights.layers[1]  # conv + dense, attn + MoE
    assert isinstance(attn.mixer.qkv, Fp8Weight) and isinstance(attn.ffn.w1, Fp8Weight)
    assert isinstance(conv.mixer.in_proj, Fp8Weight) and isinstance(conv.ffn.w2, Fp8Weight)
    assert not isinstance(attn.ffn.gate, Fp8Weight)  # the router stays


def test_quantized_at_load_equals_the_fp8_checkpoint(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    quantized, stored = testing.assert_quantized_at_load_equals_fp8_checkpoint(
        tiny_paths["attn_first"], tmp_path, LFM2_MOE.fp8_linears, load, PROMPT
    )
    a, b = quantized.weights.layers[0].mixer.qkv, stored.weights.layers[0].mixer.qkv
    assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
    assert torch.equal(a.scale, b.scale)


def test_plan_counts_fp8_bytes(tiny_paths: dict[str, Path], tmp_path: Path) -> None:
    bf16 = testing.write_bf16_checkpoint(tiny_paths["lfm2_tiny"], tmp_path / "bf16")
    ckpt = Checkpoint.open(bf16)
    before = ckpt.local_bytes()
    ckpt.set_quantization(LFM2_MOE.fp8_linears)
    fp8, _ = testing.write_fp8_checkpoints(bf16, tmp_path, LFM2_MOE.fp8_linears, "block")
    assert ckpt.local_bytes() == Checkpoint.open(fp8).local_bytes() < before


class TestFp8WeightGates(conformance.Fp8WeightGates):
    family, build_demo = "lfm2_moe", build_demo
    ids, lengths, max_tokens = (5, 700), (9, 130, 600), 6


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_a_rank_of_tp_2_loads_its_cut_of_the_fp8_weights(
    fmt: str, tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    """Each rank's fp8 weights (heads, channels, sections of in_proj, its experts) are, value for
    value, its cut of the same weights dequantized."""
    fp8, dequantized = testing.write_fp8_checkpoints(
        tiny_paths["lfm2_tiny"], tmp_path, LFM2_MOE.fp8_linears, fmt
    )
    raw = json.loads((fp8 / "config.json").read_text())
    cfg = Lfm2MoeConfig.from_dict(raw)
    for rank in range(2):
        loaded = []
        for folder in (fp8, dequantized):
            ckpt = Checkpoint.open(folder)
            ckpt.set_shard(Shard(rank, 2, shards.plan(cfg, "float32", 2)))
            loaded.append(load_weights(ckpt, cfg, "cpu", torch.float32))
        pairs = list(zip(tensors(loaded[0]), tensors(loaded[1])))
        assert sum(isinstance(a, Fp8Weight) for a, _ in pairs) > 10
        for a, b in pairs:
            assert torch.equal(a.dequantize() if isinstance(a, Fp8Weight) else a, b)


def tensors(obj: object) -> list:
    """Every weight of a dataclass tree, in field order."""
    if isinstance(obj, (torch.Tensor, Fp8Weight)):
        return [obj]
    if isinstance(obj, list):
        return [t for x in obj for t in tensors(x)]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in tensors(getattr(obj, f.name))]
    return []


def test_dummy_weights_quantize_as_loaded(tmp_path: Path) -> None:
    """TF_LOAD_FORMAT=dummy --quantization fp8 (the benchmarks' shapes): fp8 where the loader
    puts it, each layer quantized as it is drawn to the bits of quantizing after."""
    from functools import partial

    from tensorfold_lfm2_moe.config import Lfm2MoeConfig
    from tensorfold_lfm2_moe.dummy import dummy_weights, load_dummy, quantize_layer

    folder = build_demo(tmp_path)
    testing.assert_dummy_quantizes_as_loaded(load, load_dummy, folder, LFM2_MOE.fp8_linears)
    cfg = Lfm2MoeConfig.from_dict(Checkpoint.open(folder).config)
    draw = partial(dummy_weights, cfg, "cpu", torch.bfloat16, seed=0, std=0.1)
    testing.assert_quantized_as_drawn(draw, quantize_layer)
