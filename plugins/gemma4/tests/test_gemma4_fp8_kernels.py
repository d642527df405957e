"""gemma4's own GPU paths with fp8 weights (issue 58), on the CPU under TRITON_INTERPRET=1 in
fp32: layers.mlp and layers.experts_ffn take the fp8 kernels (tensorfold.ops.triton_fp8) with
the bits of the bf16 kernels over the dequantized weights, and the tiny model under
--quantization fp8 runs through the kernels with no weight dequantized, within rounding of the
torch path."""

from __future__ import annotations

import os
from typing import Any, Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="the Triton kernels need triton")

from tensorfold import testing  # noqa: E402
from tensorfold.engine.runner import ModelRunner  # noqa: E402
from tensorfold.family.forward_pass import StreamRows  # noqa: E402
from tensorfold.ops import gpu  # noqa: E402
from tensorfold.ops.fp8 import Fp8Weight, quantize_blocks  # noqa: E402
from tensorfold_gemma4 import layers  # noqa: E402
from tensorfold_gemma4.config import FULL, SLIDING, Gemma4Config  # noqa: E402
from tensorfold_gemma4.dummy import CONFIGS, build_dummy  # noqa: E402
from tensorfold_gemma4.weights import MlpWeights  # noqa: E402

F32 = torch.float32
TINY = {  # the 26B's layout at toy widths: the MoE beside the MLP
    **CONFIGS["Gemma-4-26B-A4B"],
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "layer_types": [SLIDING, FULL],
    "sliding_window": 16,
    "num_experts": 8,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}


@pytest.fixture
def counts() -> Iterator[dict[str, int]]:
    """The GPU path on CPU tensors; launches of the fp8 FFN kernels and Fp8Weight.dequantize
    calls, counted."""
    with testing.fp8_kernel_counts("gated_ffn_fp8", "moe_fp8") as seen:
        yield seen


def tiny_fp8() -> Any:
    cfg = Gemma4Config.from_dict(TINY)
    return build_dummy(cfg, "cpu", F32, seed=3, std=0.1, quantization="fp8")


def test_mlp_and_experts_take_the_fp8_kernels_with_the_bf16_kernels_bits(counts) -> None:
    layer = tiny_fp8().weights.layers[0]
    mlp, moe = layer.mlp, layer.moe
    assert isinstance(mlp.gate, Fp8Weight) and isinstance(moe.gate_up, Fp8Weight)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(2))
    experts = torch.tensor([[0, 3], [1, 3], [7, 0], [2, 1], [0, 2], [5, 6]])
    got_mlp = layers.mlp(mlp, x)
    got_moe = layers.experts_ffn(x, weights, experts, moe.gate_up, moe.down)
    assert counts == {"gated_ffn_fp8": 1, "moe_fp8": 1, "dequantize": 0}
    plain = MlpWeights(*(w.dequantize(F32) for w in (mlp.gate, mlp.up, mlp.down)))
    assert torch.equal(got_mlp, layers.mlp(plain, x))
    gate_up, down = moe.gate_up.dequantize(F32), moe.down.dequantize(F32)
    assert torch.equal(got_moe, layers.experts_ffn(x, weights, experts, gate_up, down))


def test_experts_whose_up_half_starts_inside_a_row_block_take_the_kernel(counts) -> None:
    """I = 96 (as the 26B's 704, no multiple of 128): the fused gate/up's 128-row blocks span
    both halves, the up half starts 96 rows into block 0 and is read as a view (row0 96), with
    the bits of the bf16 kernels over the dequantized weights."""
    g = torch.Generator().manual_seed(4)
    gate_up = quantize_blocks(torch.randn(8, 2 * 96, 64, generator=g) * 0.2)
    down = quantize_blocks(torch.randn(8, 64, 96, generator=g) * 0.2)
    x = torch.randn(6, 64, generator=g)
    weights = torch.rand(6, 2, generator=g)
    experts = torch.tensor([[0, 3], [1, 3], [7, 0], [2, 1], [0, 2], [5, 6]])
    got = layers.experts_ffn(x, weights, experts, gate_up, down)
    assert counts == {"gated_ffn_fp8": 0, "moe_fp8": 1, "dequantize": 0}
    plain = gate_up.dequantize(F32), down.dequantize(F32)
    assert torch.equal(got, layers.experts_ffn(x, weights, experts, *plain))


def test_the_model_under_fp8_runs_through_the_kernels_alone(counts) -> None:
    model = tiny_fp8()
    tokens = [(11 * j) % 380 + 3 for j in range(20)]

    def logits() -> torch.Tensor:
        runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512)
        (first,) = runner.run([StreamRows(0, 0, tokens, [0], "all")])
        (step,) = runner.run([StreamRows(0, len(tokens), [5], [0], "last")])
        return torch.cat([first, step])

    got = logits()
    assert counts["dequantize"] == 0 and counts["gated_ffn_fp8"] and counts["moe_fp8"]
    gpu.set_triton(False)
    want = logits()
    err = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-4, float(err.max())
