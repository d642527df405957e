"""Tiny Gemma 4 checkpoints saved by transformers 5.23.0 (the reference), and our model on them.

Built once a session:
- "e_style": the first tiny config checked against the reference (a ConditionalGeneration
  checkpoint): sliding window 8, k_eq_v, the MoE beside the dense MLP, per-layer embeddings, two
  KV-sharing layers with the double-wide MLP, softcap.
- "a26b_style": Gemma-4-26B-A4B's layout at toy size: 5:1-ish sliding/full, window 100, k_eq_v,
  six experts top-3, no per-layer embeddings, no KV sharing, bidirectional-vision flag.
- "causal_lm": a text-only `Gemma4ForCausalLM` (weights under `model.`): v_proj on full layers,
  no MoE, partial "proportional" RoPE at half width, a KV-sharing full layer, an untied lm_head
  and no softcap. Checked for parity only.

Zero- or one-initialised parameters are perturbed (norm weights, layer_scalar, router scales),
and the router is drawn wide enough that no top-k choice is a near tie (asserted), so a 1e-7
difference in a router logit cannot flip an expert.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from gemma4_media_configs import MEDIA_IDS

from tensorfold import testing
from tensorfold.engine.cpu_threads import one_cpu_thread
from tensorfold_gemma4.model import load

PROMPT_LEN = 600  # crosses a 512-row page and every sliding window here
S, F = "sliding_attention", "full_attention"
COMMON: dict[str, Any] = dict(
    vocab_size=256,
    vocab_size_per_layer_input=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    max_position_embeddings=4096,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
PLACEHOLDERS = MEDIA_IDS
SHAPES: dict[str, dict[str, Any]] = {
    "e_style": dict(
        num_hidden_layers=6,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, F] * 3,
        sliding_window=8,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
            },
        },
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        hidden_size_per_layer_input=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    "a26b_style": dict(
        num_hidden_layers=6,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        layer_types=[S, S, F, S, S, F],
        sliding_window=100,
        enable_moe_block=True,
        num_experts=6,
        top_k_experts=3,
        moe_intermediate_size=24,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        final_logit_softcapping=30.0,
        use_bidirectional_attention="vision",
        tie_word_embeddings=True,
    ),
    "causal_lm": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, F],
        sliding_window=16,
        rope_parameters={
            S: {"rope_type": "default", "rope_theta": 10000.0},
            F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 10000.0},
        },
        hidden_size_per_layer_input=8,
        num_kv_shared_layers=1,
        tie_word_embeddings=False,
    ),
}
BATTERY = ("e_style", "a26b_style")  # the shapes every pass and decode test runs on
FIXTURE_SEEDS = {"e_style": 0, "a26b_style": 1, "causal_lm": 2}
MIN_ROUTER_GAP = 1e-5  # between the k-th and (k+1)-th router probability, every row and layer


def build_reference(shape: str) -> Any:
    from transformers import (
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
    )

    torch.manual_seed(FIXTURE_SEEDS[shape])
    text = {**COMMON, **SHAPES[shape]}
    if shape == "causal_lm":
        model = Gemma4ForCausalLM(Gemma4TextConfig(**text))
    else:
        config = Gemma4Config(
            text_config=text,
            vision_config=None,
            audio_config=None,
            tie_word_embeddings=True,
            **PLACEHOLDERS,
        )
        model = Gemma4ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(FIXTURE_SEEDS[shape] + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("router.scale", "router.per_expert_scale")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith("router.proj.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.7 + 0.3 * torch.rand(b.shape, generator=gen))
    return model.eval()


def reference_class(shape: str) -> Any:
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    return Gemma4ForCausalLM if shape == "causal_lm" else Gemma4ForConditionalGeneration


class Tiny(testing.ReferenceCase):
    def ref_logits(self) -> torch.Tensor:
        """The reference's logits, checking the first time that no router choice was a near
        tie (a near tie could go either way between two correct implementations)."""
        if "logits" in self._cache:
            return self._cache["logits"]
        probs: list[torch.Tensor] = []
        hooks = [
            m.register_forward_hook(lambda mod, i, out: probs.append(out[0]))
            for name, m in self.ref.named_modules()
            if name.endswith("router")
        ]
        try:
            logits = super().ref_logits()
        finally:
            for h in hooks:
                h.remove()
        k = self.model.cfg.top_k_experts
        for p in probs:
            top = p.topk(k + 1, dim=-1).values
            assert (top[:, k - 1] - top[:, k]).min() > MIN_ROUTER_GAP, "a near-tie route"
        return logits


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: a second OpenMP thread gains nothing, and on a busy machine each
    parallel region waits for a free core (100x slower on a shared 2-core box). One thread per
    module; the setting is restored after it."""
    with one_cpu_thread():
        yield


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return testing.reference_folders(tmp_path_factory, "gemma4_tiny", SHAPES, build_reference)


def _open(name: str, paths: dict[str, Path]) -> Tiny:
    return Tiny.open(
        name,
        paths[name],
        reference_class(name),
        load,
        vocab=COMMON["vocab_size"],
        prompt_len=PROMPT_LEN,
    )


@pytest.fixture(scope="session", params=BATTERY)
def tiny(request: pytest.FixtureRequest, tiny_paths: dict[str, Path]) -> Tiny:
    return _open(request.param, tiny_paths)


@pytest.fixture(scope="session")
def causal(tiny_paths: dict[str, Path]) -> Tiny:
    return _open("causal_lm", tiny_paths)
