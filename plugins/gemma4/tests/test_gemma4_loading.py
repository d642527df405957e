"""gemma4's registration, state layout, config parsing and loader: what it reads, derives and
refuses, and checkpoints with vision and audio towers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from gemma4_media_configs import MEDIA_IDS, TINY_TEXT

from tensorfold import testing
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family import FamilySpec, resolve
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_gemma4 import plugin
from tensorfold_gemma4.config import ConfigError, Gemma4Config
from tensorfold_gemma4.model import load, shape

if TYPE_CHECKING:
    from conftest import Tiny


def test_plugin_registers_the_family() -> None:
    found: list[FamilySpec] = []
    plugin.register_families(found.append)
    (spec,) = found
    assert spec.name == "gemma4"
    assert resolve(spec.load) is load and resolve(spec.shape) is shape
    assert callable(resolve(spec.build_demo))
    rows: list[object] = []
    plugin.profile_rows(rows.append)
    assert rows == []


def test_layout_pages_full_layers_and_rings_sliding_ones_and_nothing_for_reuse(
    tiny: "Tiny",
) -> None:
    text = tiny.ref.config.get_text_config()
    owners = [i for i, mode in enumerate(text.kv_sharing_modes) if mode != "reuse"]
    full = [i for i in owners if text.layer_types[i] == "full_attention"]
    sliding = [i for i in owners if i not in full]
    layout = tiny.model.layout
    assert [r.name for r in layout.paged] == [f"L{i}.{kv}" for i in full for kv in "kv"]
    assert [s.name for s in layout.fixed] == [f"L{i}.{kv}" for i in sliding for kv in ("sk", "sv")]
    for i in owners:
        attn = tiny.ref.model.language_model.layers[i].self_attn
        row = (attn.k_proj.out_features // attn.head_dim, attn.head_dim)
        if i in full:
            k, v = (r for r in layout.paged if r.name.startswith(f"L{i}."))
            assert k.shape == v.shape == row and k.window is None
        else:
            k, v = (s for s in layout.fixed if s.name.startswith(f"L{i}."))
            assert k.shape == v.shape == (attn.sliding_window - 1, *row)
    assert layout.mark_rows == 1
    config = json.loads((tiny.path / "config.json").read_text())
    assert shape(config, "float32").layout == layout
    half = shape(config, "bfloat16").layout
    assert half.row_bytes * 2 == layout.row_bytes and half.fixed_bytes * 2 == layout.fixed_bytes


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg["text_config"] if "text_config" in cfg else cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_global_head_dim_keys_derive_the_same_layers(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    """Configs that carry `global_head_dim` / `num_global_key_value_heads` instead of a saved
    `per_layer_config` derive the full layers' shape as Gemma4TextConfig.__post_init__ does."""

    def to_global_keys(text: dict) -> None:
        overrides = next(iter(text.pop("per_layer_config").values()))
        text["global_head_dim"] = overrides["head_dim"]
        text["num_global_key_value_heads"] = overrides["num_key_value_heads"]

    src = tiny_paths["e_style"]
    folder = _rewrite(src, tmp_path / "global_keys", to_global_keys)
    ours = Gemma4Config.from_dict(json.loads((folder / "config.json").read_text()))
    saved = Gemma4Config.from_dict(json.loads((src / "config.json").read_text()))
    assert ours.layers == saved.layers
    assert [layer.head_dim for layer in ours.layers] == [16, 32] * 3


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: t.update(layer_types=["sliding_attention", "chunked_attention"] * 3),
            "'chunked_attention'",
        ),
        (lambda t: t["rope_parameters"]["full_attention"].update(rope_type="yarn"), "'yarn'"),
        (lambda t: t.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
        (lambda t: t.update(use_bidirectional_attention="all"), "causal"),
        (lambda t: t.update(hidden_activation="silu"), "'silu'"),
        (lambda t: t.update(num_kv_shared_layers=6), "num_kv_shared_layers=6"),
    ],
)
def test_bad_configs_are_refused_before_loading(
    tiny_paths: dict[str, Path], tmp_path: Path, edit, message: str
) -> None:
    folder = _rewrite(tiny_paths["e_style"], tmp_path / "bad", edit)
    with pytest.raises(ConfigError, match=message):
        shape(json.loads((folder / "config.json").read_text()), "float32")
    with pytest.raises(ConfigError, match=message):
        load(Checkpoint.open(folder), "cpu", "float32")


def test_missing_and_misshapen_tensors_are_named(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    testing.assert_missing_and_misshapen_named(
        tiny_paths["a26b_style"],
        tmp_path,
        load,
        ["model.language_model.layers.3.experts.down_proj"],
        "model.language_model.layers.2.self_attn.k_proj.weight",
    )


def test_towers_load_beside_the_text_model(tmp_path: Path) -> None:
    """A checkpoint with vision and audio towers serves its text model as the reference computes
    it (text-only input) and loads both towers beside it, skipping nothing."""
    from structlog.testing import capture_logs
    from transformers import Gemma4Config as HFConfig
    from transformers import Gemma4ForConditionalGeneration

    text = dict(TINY_TEXT, initializer_range=0.1)
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        position_embedding_size=64,
    )
    audio = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[8, 4],
        output_proj_dims=32,
    )
    torch.manual_seed(3)
    ref = Gemma4ForConditionalGeneration(
        HFConfig(
            text_config=text,
            vision_config=vision,
            audio_config=audio,
            **MEDIA_IDS,
        )
    ).eval()
    ref.save_pretrained(tmp_path)
    with capture_logs() as logs:
        model = load(Checkpoint.open(tmp_path), "cpu", "float32")
    assert not [e for e in logs if "skipped" in e["event"]]
    assert model.vision_weights is not None and model.audio_weights is not None
    prompt = list(range(200, 256)) * 2  # with the image, video and audio placeholders
    with torch.no_grad():
        want = ref(input_ids=torch.tensor([prompt])).logits[0]
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    (got,) = runner.run([open_stream(runner, 0, len(prompt)).rows(prompt, logits="all")])
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
