"""`--load-format dummy --quantization fp8` quantizes each layer as soon as it is drawn (so a
model whose bf16 weights would not fit beside their fp8 copy still builds): the weights equal
those of drawing every layer in bf16 first and quantizing after, for each family."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tensorfold import testing
from tensorfold.ops.fp8 import Fp8Weight

BF16 = torch.bfloat16


def lfm2() -> tuple[Any, Any]:
    from dataclasses import replace

    dummy = pytest.importorskip("tensorfold_lfm2_moe.dummy")
    cfg = replace(
        dummy.SHAPES["LFM2-8B-A1B"],
        num_hidden_layers=3,
        layer_types=("conv", "full_attention", "conv"),
        vocab_size=256,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=4,
        num_dense_layers=1,
    )
    return dummy, cfg


def gemma4() -> tuple[Any, Any]:
    dummy = pytest.importorskip("tensorfold_gemma4.dummy")
    from tensorfold_gemma4.config import Gemma4Config

    tiny = {
        **dummy.CONFIGS["Gemma-4-26B-A4B"],
        "vocab_size": 384,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 16,
        "num_experts": 8,
        "top_k_experts": 2,
        "moe_intermediate_size": 32,
    }
    return dummy, Gemma4Config.from_dict(tiny)


def glm() -> tuple[Any, Any]:
    dummy = pytest.importorskip("tensorfold_glm.dummy")
    from tensorfold_glm.config import GlmConfig

    tiny = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 48,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "indexed_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "indexer_types": ["full", "full"],
        "linear_num_heads": 2,
        "linear_head_dim": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "index_head_dim": 16,
        "index_n_heads": 4,
        "index_topk": 8,
        "index_kpool": 4,
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
    }
    return dummy, GlmConfig.from_dict(tiny, "test")


def same(a: Any, b: Any) -> bool:
    if isinstance(a, Fp8Weight):
        return (
            isinstance(b, Fp8Weight)
            and (a.block, a.row0) == (b.block, b.row0)
            and torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8))
            and torch.equal(a.scale, b.scale)
        )
    return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("family", [lfm2, gemma4, glm], ids=["lfm2_moe", "gemma4", "glm5_next"])
def test_each_layer_quantized_as_drawn_equals_quantizing_after(family: Callable) -> None:
    dummy, cfg = family()
    streamed = dummy.dummy_weights(cfg, "cpu", BF16, seed=0, std=0.1, fp8=True)
    after = dummy.dummy_weights(cfg, "cpu", BF16, seed=0, std=0.1)
    after.layers = [dummy.quantize_layer(layer) for layer in after.layers]
    got, want = testing.weight_leaves(streamed), testing.weight_leaves(after)
    assert got.keys() == want.keys()
    assert sum(isinstance(w, Fp8Weight) for w in got.values()) > 0
    assert [k for k in got if not same(got[k], want[k])] == []
