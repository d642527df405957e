"""Tiny GLM-5.3-Flash checkpoints saved by transformers 5.23.0 (the reference), and our model on
them.

Built once a session: the first tiny config checked against the reference (4-token pools, two
pools selected, a "shared" indexer layer, expert groups), and a second shape with 16-token
pools, MLA first, attention biases, no forget-gate lower bound, a kernel-3 conv, two mHC
streams, one expert group and no top-k renormalisation. Both have 16 indexer heads (with 2,
ReLU-zero score ties made the reference's prefix-20 logits differ from a 27-token run's first 20
by 0.15; with 16, by 1e-7) and a one-block vision tower. Parameters the reference initialises to
zeros or ones are perturbed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tensorfold import testing
from tensorfold.engine.cpu_threads import one_cpu_thread
from tensorfold_glm.model import load

Tiny = testing.ReferenceCase  # the fixtures' type, by the name the tests use

PROMPT_LEN = 600  # crosses a 512-row page; far past the point where the pool selection is sparse
COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=0,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    index_head_dim=16,
    index_n_heads=16,
    swiglu_limit=10.0,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SHAPES: dict[str, dict[str, Any]] = {
    # KDA + dense, MLA (own indexer) + MoE in 2 groups, MLA (shared indexer) + MoE, KDA + MoE
    "glm_tiny": dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
        ],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        index_topk=8,
        index_kpool=4,
        linear_num_heads=2,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
    ),
    "glm_pools16": dict(
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_bias=True,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        layer_types=[
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
            "indexed_attention",
            "linear_attention",
        ],
        indexer_types=["full", "shared", "full", "full", "full"],
        mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
        index_topk=32,
        index_kpool=16,
        linear_num_heads=4,
        linear_head_dim=8,
        linear_conv_kernel_dim=3,
        linear_lower_bound=None,
        hc_mult=2,
        hc_sinkhorn_iters=7,
    ),
}
VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=2,
    intermediate_size=64,
    out_hidden_size=64,
    projection_intermediate_size=64,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
MM_IDS = dict(
    image_token_id=250,
    video_token_id=251,
    image_start_token_id=252,
    image_end_token_id=253,
    video_start_token_id=254,
    video_end_token_id=255,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Intra-op threads only add overhead at these sizes, and make every small op crawl when the
    machine's cores are shared; restored after each module, so other suites keep theirs."""
    with one_cpu_thread():
        yield


def build_reference(shape: str, seed: int = 0) -> Any:
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**COMMON, **SHAPES[shape]}, vision_config=VISION, **MM_IDS)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            zeros = ("e_score_correction_bias", "compress_ape", "A_log", "hc.base")
            if any(s in name for s in zeros):
                p.normal_(0, 0.5)
            elif "hc.scale" in name:
                p.uniform_(0.5, 1.5)
            elif "compress_gate" in name:
                p.normal_(0, 0.05)
            elif "o_norm.weight" in name or "indexer.k_norm.weight" in name:
                p.normal_(1.0, 0.1)
            elif "indexer.k_norm.bias" in name or "self_attn" in name and name.endswith(".bias"):
                p.normal_(0.0, 0.1)
        for layer in model.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return testing.reference_folders(tmp_path_factory, "glm_tiny", SHAPES, build_reference)


@pytest.fixture(scope="session", params=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tiny_paths: dict[str, Path]) -> Tiny:
    from transformers import Glm5NextForConditionalGeneration

    name = request.param
    return Tiny.open(
        name,
        tiny_paths[name],
        Glm5NextForConditionalGeneration,
        load,
        vocab=250,
        prompt_len=PROMPT_LEN,
    )


# -- the kernels path on the CPU (Triton interpreted) ------------------------------------------


@pytest.fixture
def kernels_on_cpu() -> Iterator[None]:
    from tensorfold.ops import gpu

    gpu.set_triton(True, on_cpu=True)
    yield
    gpu.set_triton(True)


@pytest.fixture(params=[False, True], ids=["fla_recurrent", "own_recurrent"])
def own_recurrent(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Both ways of the KDA recurrent rows (switches.OWN_RECURRENT)."""
    from tensorfold.ops import switches

    with switches.switched(switches.OWN_RECURRENT, request.param):
        yield request.param


def _kda_model(dtype: torch.dtype, head_dim: int = 16) -> Any:
    """One KDA layer (2 heads of head_dim) and a dense FFN, dummy weights. Three Sinkhorn
    iterations, not GLM's 20: the mHC collapse's loop still runs (twice), and under the
    interpreter every iteration is a dozen launches' worth of interpreted ops; the mHC kernels'
    own tests keep the 20."""
    from tensorfold_glm.config import GlmConfig
    from tensorfold_glm.dummy import build_dummy

    cfg = GlmConfig.from_dict(
        {
            "vocab_size": 96,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "layer_types": ["linear_attention"],
            "mlp_layer_types": ["dense"],
            "linear_num_heads": 2,
            "linear_head_dim": head_dim,
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
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "hc_sinkhorn_iters": 3,
        },
        "test",
    )
    return build_dummy(cfg, "cpu", dtype, seed=0, std=0.2)


@pytest.fixture
def kda_model() -> Any:
    """The builder: kda_model(dtype, head_dim=16) -> a KDA-only model."""
    return _kda_model
