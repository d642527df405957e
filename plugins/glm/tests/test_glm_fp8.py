"""glm5_next with fp8 weights (docs/fp8.md): each FP8 format against transformers on the same
weights dequantized (fp32, within 1e-4), and `--quantization fp8` of a bf16 checkpoint equal,
bit for bit, to the same weights written as an FP8 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import conformance, testing
from tensorfold.ops.fp8 import Fp8Weight
from tensorfold_glm.demo import build_demo
from tensorfold_glm.model import load
from tensorfold_glm.plugin import GLM5_NEXT
from tensorfold_glm.weights import KdaWeights, MlaWeights, MoeWeights

TOL = 1e-4
PROMPT = list(range(3, 43))  # past the tiny pools; the long-prompt parity is test_glm_parity's


@pytest.mark.parametrize("fmt", testing.FP8_FORMATS)
def test_fp8_checkpoint_matches_reference_on_its_weights(
    fmt: str, tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import Glm5NextForConditionalGeneration

    model, err = testing.fp8_parity(
        tiny_paths["glm_tiny"],
        tmp_path,
        GLM5_NEXT.fp8_linears,
        fmt,
        Glm5NextForConditionalGeneration,
        load,
        PROMPT,
    )
    assert err < TOL
    kda, mla, moe = (model.weights.layers[i] for i in (0, 1, 1))
    assert isinstance(kda.mixer, KdaWeights) and isinstance(mla.mixer, MlaWeights)
    assert isinstance(kda.mixer.x_maps, Fp8Weight) and isinstance(kda.mixer.f_a, Fp8Weight)
    assert isinstance(mla.mixer.q_b, Fp8Weight) and not isinstance(mla.mixer.w_uk, Fp8Weight)
    assert isinstance(moe.ffn, MoeWeights) and isinstance(moe.ffn.experts[0].gate_up, Fp8Weight)
    assert not isinstance(moe.ffn.router, Fp8Weight)


def test_quantized_at_load_equals_the_fp8_checkpoint(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    testing.assert_quantized_at_load_equals_fp8_checkpoint(
        tiny_paths["glm_pools16"], tmp_path, GLM5_NEXT.fp8_linears, load, PROMPT
    )


class TestFp8WeightGates(conformance.Fp8WeightGates):
    family, build_demo = "glm5_next", build_demo
    ids, lengths, max_tokens = (20, 800), (9, 130, 300), 6

    def test_mtp_drafted_equals_plain_within_fp8_weights(self, demo: Path) -> None:
        """--draft mtp: the MTP layer's linears load in fp8 too, and its drafts change nothing."""
        llm = testing.open_llm(
            self.family, demo, quantization="fp8", draft="mtp", context=1024, parallel=4
        )
        try:
            model = llm.served.engine.lanes.runner.model
            assert model.weights.mtp is not None
            assert isinstance(model.weights.mtp.eh_proj, Fp8Weight)
            for params in (conformance.greedy(12), conformance.seeded(7, 12)):
                testing.assert_drafted_equals_plain(
                    llm, ["Once upon a time", "The garden in the morning"], params, source="mtp"
                )
        finally:
            testing.close_even(llm)


def test_dummy_weights_quantize_as_loaded(tmp_path: Path) -> None:
    """TF_LOAD_FORMAT=dummy --quantization fp8 (the benchmarks' shapes): fp8 where the loader
    puts it, each layer quantized as it is drawn to the bits of quantizing after."""
    from functools import partial

    from tensorfold.family.checkpoint import Checkpoint
    from tensorfold_glm.config import GlmConfig
    from tensorfold_glm.dummy import dummy_weights, load_dummy, quantize_layer

    folder = build_demo(tmp_path)
    testing.assert_dummy_quantizes_as_loaded(load, load_dummy, folder, GLM5_NEXT.fp8_linears)
    cfg = GlmConfig.from_dict(Checkpoint.open(folder).config)
    draw = partial(dummy_weights, cfg, "cpu", torch.bfloat16, seed=0, std=0.1)
    testing.assert_quantized_as_drawn(draw, quantize_layer)
