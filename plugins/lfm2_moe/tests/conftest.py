"""Tiny LFM2-MoE checkpoints saved by transformers 5.23.0 (the reference), and our model on them.

Built once a session: the first tiny config checked against the reference (conv + dense,
attention + MoE, conv + MoE layers), and a second shape with attention first,
other head_dim / KV heads / experts / top-k, two dense layers, conv biases and no top-k
renormalisation. Seeds are fixed, expert_bias is perturbed (it initialises to zeros) and
initializer_range is 0.1 (at 0.02 greedy decoding repeats one token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold import testing
from tensorfold_lfm2_moe.model import load

Tiny = testing.ReferenceCase  # the fixtures' type, by the name the tests use

PROMPT_LEN = 600  # crosses a 512-row page
COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    initializer_range=0.1,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    norm_eps=1e-5,
    conv_L_cache=3,
)
SHAPES: dict[str, dict[str, Any]] = {
    # conv + dense, attention + MoE, conv + MoE
    "lfm2_tiny": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_dense_layers=1,
        num_experts=8,
        num_experts_per_tok=2,
        use_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        conv_bias=False,
    ),
    "attn_first": dict(
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        layer_types=["full_attention", "conv", "conv", "full_attention", "conv"],
        num_dense_layers=2,
        num_experts=6,
        num_experts_per_tok=3,
        use_expert_bias=True,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        conv_bias=True,
        rope_theta=10000.0,
    ),
}


def build_reference(shape: str, seed: int = 0) -> Any:
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    torch.manual_seed(seed)
    model = Lfm2MoeForCausalLM(Lfm2MoeConfig(**COMMON, **SHAPES[shape])).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.feed_forward, "expert_bias"):
                layer.feed_forward.expert_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return testing.reference_folders(tmp_path_factory, "lfm2_moe_tiny", SHAPES, build_reference)


@pytest.fixture(scope="session", params=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tiny_paths: dict[str, Path]) -> Tiny:
    from transformers import Lfm2MoeForCausalLM

    name = request.param
    return Tiny.open(
        name,
        tiny_paths[name],
        Lfm2MoeForCausalLM,
        load,
        vocab=COMMON["vocab_size"],
        prompt_len=PROMPT_LEN,
    )
