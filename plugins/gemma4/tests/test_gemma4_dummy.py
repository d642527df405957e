"""TF_LOAD_FORMAT=dummy for gemma4: a checkpoint folder with no weights serves the config's shape
with random weights from a fixed seed (for benchmarks), through the same lanes; and the
Gemma-4-26B-A4B shape the benchmark builds (its published text_config: 25.23B parameters)."""

from __future__ import annotations

import torch

from tensorfold import conformance
from tensorfold_gemma4.config import FULL, SLIDING
from tensorfold_gemma4.demo import build_demo
from tensorfold_gemma4.dummy import SHAPES, build_dummy


def tensors(obj: object) -> list[torch.Tensor]:
    """Every distinct tensor a weights dataclass holds (a view of another it holds, as q of qkv,
    counts once, as its base)."""
    found: dict[int, torch.Tensor] = {}

    def walk(o: object) -> None:
        if isinstance(o, torch.Tensor):
            found[id(o)] = o
        elif isinstance(o, list):
            for x in o:
                walk(x)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:  # type: ignore[attr-defined]
                walk(getattr(o, name))

    walk(obj)
    return [t for t in found.values() if t._base is None or id(t._base) not in found]


class TestDummyWeights(conformance.DummyWeights):
    family, build_demo = "gemma4", build_demo
    dummy_context, dummy_prompt, dummy_tokens_vary = 1024, 200, True

    def test_the_26b_shape_matches_its_published_config(self) -> None:
        cfg = SHAPES["Gemma-4-26B-A4B"]
        kinds = cfg.layer_types
        assert len(kinds) == 30 and kinds.count(FULL) == 5 and kinds[5::6] == (FULL,) * 5
        sliding = [layer for layer in cfg.layers if layer.kind == SLIDING]
        full = [layer for layer in cfg.layers if layer.kind == FULL]
        assert {(x.kv_heads, x.head_dim, x.window, x.k_eq_v) for x in sliding} == {
            (8, 256, 1024, False)
        }
        assert {(x.kv_heads, x.head_dim, x.window, x.k_eq_v) for x in full} == {
            (2, 512, None, True)
        }
        assert (cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size) == (2816, 16, 262144)
        assert (cfg.num_experts, cfg.top_k_experts, cfg.moe_intermediate_size) == (128, 8, 704)
        assert cfg.intermediate_size == 2112 and cfg.final_logit_softcapping == 30.0
        assert cfg.rope[FULL].rope_type == "proportional" and cfg.rope[FULL].theta == 1e6
        assert cfg.rope[FULL].partial_rotary_factor == 0.25 and cfg.rope[SLIDING].theta == 1e4
        model = build_dummy(cfg, device="meta")  # shapes only
        assert sum(t.numel() for t in tensors(model.weights)) == 25_233_141_790  # 25.23B
        moe = model.weights.layers[0].moe
        assert moe is not None
        assert moe.gate_up.shape == (128, 1408, 2816) and moe.down.shape == (128, 2816, 704)

    def test_dummy_activations_stay_finite_in_bf16(self) -> None:
        """The 26B shape's widths and head layout on two layers with a small vocabulary: a bf16
        prompt's logits are finite and not flat."""
        from dataclasses import replace

        from tensorfold.engine.runner import ModelRunner
        from tensorfold.family.forward_pass import StreamRows

        cfg = SHAPES["Gemma-4-26B-A4B"]
        small = replace(
            cfg,
            vocab_size=512,
            num_hidden_layers=2,
            layers=cfg.layers[4:6],
            num_experts=16,
            top_k_experts=8,
        )
        small = replace(
            small,
            layers=tuple(replace(x, index=i, kv_source=i) for i, x in enumerate(small.layers)),
        )
        model = build_dummy(small, device="cpu", dtype=torch.bfloat16, seed=1)
        runner = ModelRunner(model, num_pages=2, num_slots=1, page_rows=512)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 512, (40,), generator=g).tolist()
        (logits,) = runner.run([StreamRows(0, 0, tokens, [0], "all")])
        assert torch.isfinite(logits).all()
        assert logits.std(dim=-1).min() > 0.1
        assert logits.abs().max() <= 30.0  # the softcap
