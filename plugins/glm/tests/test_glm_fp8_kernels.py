"""glm5_next's own GPU FFN paths with fp8 weights (issue 58), on the CPU under
TRITON_INTERPRET=1 in fp32: moe.swiglu, moe.moe and moe.moe_partial take the fp8 kernels
(tensorfold.ops.triton_fp8, through triton_ffn) with no weight dequantized, and the bits of the
same calls on the dequantized weights through the bf16 kernels."""

from __future__ import annotations

import os
from typing import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.ops.fp8 import Fp8Weight  # noqa: E402
from tensorfold_glm import moe  # noqa: E402
from tensorfold_glm.config import GlmConfig  # noqa: E402
from tensorfold_glm.dummy import build_dummy  # noqa: E402
from tensorfold_glm.weights import DenseWeights, MoeWeights  # noqa: E402

F32 = torch.float32


@pytest.fixture
def counts() -> Iterator[dict[str, int]]:
    """The GPU path on CPU tensors; launches of the fp8 FFN kernels and Fp8Weight.dequantize
    calls, counted."""
    with testing.fp8_kernel_counts("gated_ffn_fp8", "moe_fp8") as seen:
        yield seen


def tiny_moe() -> tuple[GlmConfig, MoeWeights]:
    """A one-layer model's MoE (8 experts of 32 in 2 groups, top 2, a shared expert) in fp8."""
    cfg = GlmConfig.from_dict(
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 48,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 1,
            "layer_types": ["linear_attention"],
            "mlp_layer_types": ["sparse"],
            "linear_num_heads": 2,
            "linear_head_dim": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "swiglu_limit": 10.0,
        },
        "test",
    )
    ffn = build_dummy(cfg, "cpu", F32, seed=0, std=0.2, quantization="fp8").weights.layers[0].ffn
    assert isinstance(ffn, MoeWeights)
    return cfg, ffn


def dequantized(w: MoeWeights) -> MoeWeights:
    def plain(d: DenseWeights) -> DenseWeights:
        return DenseWeights(*(Fp8Weight.dequantize(x, F32) for x in (d.gate_up, d.down)))  # type: ignore[arg-type]

    return MoeWeights(
        router=w.router,
        bias=w.bias,
        experts=[plain(e) for e in w.experts],
        shared=plain(w.shared),
        first_expert=w.first_expert,
    )


def test_swiglu_moe_and_moe_partial_take_the_fp8_kernels(counts) -> None:
    cfg, w = tiny_moe()
    assert isinstance(w.experts[0].gate_up, Fp8Weight) and isinstance(w.shared.down, Fp8Weight)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1))
    got = (
        moe.swiglu(x, w.shared, cfg.swiglu_limit),
        moe.moe(cfg, x, w),
        moe.moe_partial(cfg, x, w),
    )
    assert counts["dequantize"] == 0
    assert counts["gated_ffn_fp8"] == 3 and counts["moe_fp8"] == 2
    plain = dequantized(w)
    want = (
        moe.swiglu(x, plain.shared, cfg.swiglu_limit),
        moe.moe(cfg, x, plain),
        moe.moe_partial(cfg, x, plain),
    )
    for g, v in zip(got, want):
        assert torch.equal(g, v)
