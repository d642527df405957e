"""Tiny LFM2-MoE checkpoints saved by transformers 5.23.0 (the reference), and our model on them.

Built once a session: families.md §4.1's tiny config, and a second shape with attention first,
other head_dim / KV heads / experts / top-k, two dense layers, conv biases and no top-k
renormalisation. Seeds are fixed, expert_bias is perturbed (it initialises to zeros) and
initializer_range is 0.1 (at 0.02 greedy decoding repeats one token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tensorfold.checkpoint import Checkpoint
from tensorfold.runner import ModelRunner
from tensorfold_lfm2_moe.model import Lfm2MoeModel, load

PROMPT_LEN = 600  # crosses a 512-row page
COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    initializer_range=0.1, max_position_embeddings=4096, tie_word_embeddings=True,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, norm_eps=1e-5, conv_L_cache=3,
)
SHAPES: dict[str, dict[str, Any]] = {
    # families.md §4.1
    "lfm2_tiny": dict(
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        num_dense_layers=1, num_experts=8, num_experts_per_tok=2, use_expert_bias=True,
        norm_topk_prob=True, routed_scaling_factor=1.0, conv_bias=False,
    ),
    "attn_first": dict(
        num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
        layer_types=["full_attention", "conv", "conv", "full_attention", "conv"],
        num_dense_layers=2, num_experts=6, num_experts_per_tok=3, use_expert_bias=True,
        norm_topk_prob=False, routed_scaling_factor=2.5, conv_bias=True, rope_theta=10000.0,
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


@dataclass
class Tiny:
    """One fixture checkpoint: its folder, the reference loaded back from it, our model."""

    name: str
    path: Path
    ref: Any  # transformers Lfm2MoeForCausalLM, fp32
    model: Lfm2MoeModel  # ours, fp32
    prompt: list[int]
    _cache: dict[str, Any] = field(default_factory=dict)

    def runner(self, *, num_pages: int = 8, num_slots: int = 4, page_rows: int = 512,
               model: Lfm2MoeModel | None = None, poison: bool = False) -> ModelRunner:
        return ModelRunner(model or self.model, num_pages=num_pages, num_slots=num_slots,
                           page_rows=page_rows, poison=poison)

    def ref_logits(self) -> torch.Tensor:
        """The reference's logits for every row of the prompt, [PROMPT_LEN, V] fp32."""
        if "logits" not in self._cache:
            with torch.no_grad():
                out = self.ref(input_ids=torch.tensor([self.prompt])).logits[0]
            self._cache["logits"] = out.float()
        return self._cache["logits"]

    def ref_generate(self, steps: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens after the prompt and their step logits [steps, V], via generate()."""
        key = f"generate{steps}"
        if key not in self._cache:
            self.ref.generation_config.eos_token_id = None  # run all steps
            out = self.ref.generate(
                torch.tensor([self.prompt]), max_new_tokens=steps, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(self.prompt):].tolist()
            self._cache[key] = tokens, torch.cat([s.float() for s in out.logits])
        return self._cache[key]


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers", reason="transformers 5.23.0 is the parity reference")
    root = tmp_path_factory.mktemp("lfm2_moe_tiny")
    paths = {}
    for name in SHAPES:
        paths[name] = root / name
        build_reference(name).save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="session", params=list(SHAPES))
def tiny(request: pytest.FixtureRequest, tiny_paths: dict[str, Path]) -> Tiny:
    from transformers import Lfm2MoeForCausalLM

    name = request.param
    path = tiny_paths[name]
    ref = Lfm2MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(3, COMMON["vocab_size"], (PROMPT_LEN,), generator=gen).tolist()
    return Tiny(name, path, ref, load(Checkpoint.open(path), "cpu", "float32"), prompt)
