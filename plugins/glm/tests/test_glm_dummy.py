"""TF_LOAD_FORMAT=dummy for glm5_next: a checkpoint folder with no weights serves the config's
shape with random weights from a fixed seed (for benchmarks), through the same lanes; the
tensors the real loader keeps in fp32 stay fp32; GLM-5.3-Flash-8L is the 76 GB bench shape; a
vision_config brings a random tower."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorfold import conformance
from tensorfold_glm.demo import build_demo
from tensorfold_glm.dummy import SHAPES, build_dummy
from tensorfold_glm.vision_config import VisionConfig
from tensorfold_glm.weights import HcWeights, KdaWeights, MoeWeights


class TestDummyWeights(conformance.DummyWeights):
    family, build_demo = "glm5_next", build_demo
    dummy_sampling = conformance.greedy(6)

    def test_the_fp32_tensors_stay_fp32_in_a_bf16_model(self) -> None:
        cfg = SHAPES["GLM-5.3-Flash-8L"]
        from dataclasses import replace

        tiny = replace(
            cfg,
            hidden_size=32,
            vocab_size=64,
            intermediate_size=32,
            moe_intermediate_size=16,
            n_routed_experts=4,
            linear_num_heads=2,
            linear_head_dim=16,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
            index_n_heads=4,
            index_head_dim=16,
        )
        w = build_dummy(tiny, "cpu", torch.bfloat16).weights
        kda = w.layers[0].mixer
        moe = w.layers[3].ffn
        assert isinstance(kda, KdaWeights) and isinstance(moe, MoeWeights)
        hc: HcWeights = w.layers[0].attn_hc
        for t in (kda.a_log, kda.dt_bias, kda.conv, hc.base, hc.scale, hc.fn, moe.bias, moe.router):
            assert t.dtype == torch.float32
        assert kda.qkv.dtype == torch.bfloat16 and moe.experts[1].gate_up.dtype == torch.bfloat16
        # the experts are views of one stack: expert 1 starts where expert 0 ends
        e0, e1 = moe.experts[0].gate_up, moe.experts[1].gate_up
        assert e1.data_ptr() == e0.data_ptr() + e0.numel() * e0.element_size()

    def test_the_8_layer_bench_shape_is_glm_flash_widths_at_76_gb(self) -> None:
        cfg = SHAPES["GLM-5.3-Flash-8L"]
        assert cfg.kda_layers == (0, 1, 2, 4, 5, 6) and cfg.mla_layers == (3, 7)
        assert cfg.mlp_layer_types.count("dense") == 3
        assert SHAPES["GLM-5.3-Flash"].num_hidden_layers == 45
        model = build_dummy(cfg, "meta", torch.bfloat16)
        seen = {}
        for layer in model.weights.layers:
            for obj in (layer, layer.mixer, layer.ffn, layer.attn_hc, layer.ffn_hc):
                for v in vars(obj).values():
                    if isinstance(v, torch.Tensor):
                        seen[id(v)] = v.numel() * v.element_size()
            if isinstance(layer.ffn, MoeWeights):
                e = layer.ffn.experts
                seen[id(e)] = len(e) * sum(t.numel() * 2 for t in (e[0].gate_up, e[0].down))
        total = sum(seen.values()) + 2 * model.weights.embed.numel() * 2
        assert 74e9 < total < 79e9, total


def test_a_dummy_model_has_a_tower_where_config_json_has_one(tmp_path: Path) -> None:
    import json

    from tensorfold.family.media import MediaPiece
    from tensorfold_glm.dummy import load_dummy
    from tensorfold_glm.media_processor import GlmImage

    config = json.loads((build_demo(tmp_path) / "config.json").read_text())
    model = load_dummy(config, "cpu", "float32")
    assert model.vision is not None and model.vision.cfg == VisionConfig.from_dict(
        config["vision_config"]
    )
    pixels = torch.randn(16, model.vision.cfg.patch_dim)
    piece = MediaPiece(3, 4, 1, GlmImage(pixels, (1, 4, 4)))
    (rows,) = model.encode_media([piece])
    assert rows.shape == (4, model.cfg.hidden_size) and bool(rows.isfinite().all())
    text_only = {k: v for k, v in config.items() if k != "vision_config"}
    assert load_dummy(text_only, "cpu", "float32").vision is None
    config["vision_config"]["out_hidden_size"] = 64
    with pytest.raises(ValueError, match="out_hidden_size 64 is not the text hidden_size 128"):
        load_dummy(config, "cpu", "float32")
