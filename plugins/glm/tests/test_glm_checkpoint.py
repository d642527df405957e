"""Loading real checkpoints' layouts: composite (`model.language_model.`) and flat (`model.`)
names, a vision tower loaded with its vision_config (logged and skipped without one), an MTP
layer that is ignored, and the refusals that name what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from structlog.testing import capture_logs

from tensorfold import testing
from tensorfold.engine.runner import ModelRunner, open_stream
from tensorfold.family.checkpoint import Checkpoint
from tensorfold_glm.config import ConfigError
from tensorfold_glm.model import GlmModel, load

PROMPT = list(range(3, 140))


def logits(model: GlmModel) -> torch.Tensor:
    runner = ModelRunner(model, num_pages=1, num_slots=1, page_rows=512)
    (out,) = runner.run([open_stream(runner, 0, len(PROMPT)).rows(PROMPT, logits="all")])
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def composite(tiny_paths: dict[str, Path]) -> tuple[Path, torch.Tensor]:
    path = tiny_paths["glm_tiny"]
    return path, logits(load(Checkpoint.open(path), "cpu", "float32"))


def test_composite_checkpoint_loads_its_vision_tower(
    composite: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    path, _ = composite
    assert any(n.startswith("model.visual.") for n in Checkpoint.open(path).tensor_names())
    with capture_logs() as logs:
        model = load(Checkpoint.open(path), "cpu", "float32")
    assert model.vision is not None and len(model.vision.blocks) == 1
    assert not any("images" in e["event"] for e in logs)
    # the tower's tensors without a vision_config: text alone, and the log says so
    folder = copy(path, tmp_path / "no_vision_config")
    config = json.loads((folder / "config.json").read_text())
    del config["vision_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with capture_logs() as logs:
        model = load(Checkpoint.open(folder), "cpu", "float32")
    assert model.vision is None
    assert any("images are not served" in e["event"] for e in logs)


def test_flat_text_only_checkpoint_loads_the_same_model(
    composite: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    src, want = composite
    folder = copy(src, tmp_path / "flat")
    tensors = load_file(str(folder / "model.safetensors"))
    flat = {
        k.replace("model.language_model.", "model."): v
        for k, v in tensors.items()
        if not k.startswith("model.visual.")
    }
    save_file(flat, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**cfg["text_config"], "architectures": ["Glm5NextForConditionalGeneration"]})
    )
    with capture_logs() as logs:
        model = load(Checkpoint.open(folder), "cpu", "float32")
    assert not any("images" in e["event"] for e in logs)
    assert torch.equal(logits(model), want)


def test_mtp_layer_past_the_last_is_ignored(
    composite: tuple[Path, torch.Tensor], tmp_path: Path
) -> None:
    src, want = composite
    folder = copy(src, tmp_path / "mtp")
    tensors = load_file(str(folder / "model.safetensors"))
    mtp = "model.language_model.layers.4"  # num_hidden_layers = 4: an MTP block at index 4
    extra = {
        f"{mtp}.eh_proj.weight": torch.ones(64, 128),
        f"{mtp}.shared_head.norm.weight": torch.ones(64),
        f"{mtp}.input_layernorm.weight": torch.full((64,), float("nan")),
    }
    save_file({**tensors, **extra}, str(folder / "model.safetensors"))
    with capture_logs() as logs:
        model = load(Checkpoint.open(folder), "cpu", "float32")
    assert any("MTP" in e["event"] for e in logs)
    assert torch.equal(logits(model), want)


def test_missing_and_misshapen_tensors_are_named(
    tiny_paths: dict[str, Path], tmp_path: Path
) -> None:
    missing = (
        "model.language_model.layers.3.mlp.experts.5.up_proj.weight",
        "model.language_model.layers.0.self_attn.k_conv1d.weight",
        "model.language_model.layers.1.hc_ffn_base",
    )
    misshapen = "model.language_model.layers.1.self_attn.indexer.wk.weight"
    testing.assert_missing_and_misshapen_named(
        tiny_paths["glm_tiny"], tmp_path, load, missing, misshapen
    )


def _edited(src: Path, dst: Path, **text: object) -> Path:
    folder = copy(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"].update(text)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"indexer_types": ["full", "shared", "full", "full"]},
            r"layer 1 is a \"shared\".*layer 0",
        ),
        ({"indexer_types": ["full", "full", "shared", "shared"]}, None),  # layer 3 is KDA: unused
        (
            {
                "layer_types": [
                    "linear_attention",
                    "linear_attention",
                    "indexed_attention",
                    "linear_attention",
                ],
                "indexer_types": ["full", "full", "shared", "full"],
            },
            r"layer 2 is a \"shared\".*layer 1",
        ),
        (
            {
                "layer_types": [
                    "linear_attention",
                    "sliding_attention",
                    "indexed_attention",
                    "linear_attention",
                ]
            },
            r"'sliding_attention'",
        ),
        ({"qk_rope_head_dim": 8}, "no RoPE"),
        ({"index_topk": 10}, "multiple of index_kpool=4"),
        ({"num_key_value_heads": 2}, "must equal num_attention_heads=4"),
    ],
)
def test_config_refusals_name_the_field(
    tiny_paths: dict[str, Path], tmp_path: Path, edit: dict, message: str | None
) -> None:
    folder = _edited(tiny_paths["glm_tiny"], tmp_path / "edited", **edit)
    if message is None:
        load(Checkpoint.open(folder), "cpu", "float32")
        return
    with pytest.raises(ConfigError, match=message):
        load(Checkpoint.open(folder), "cpu", "float32")


def test_experts_load_as_views_of_one_stack(composite: tuple[Path, torch.Tensor]) -> None:
    """The grouped expert kernels read a layer's experts as [E, 2I, H] / [E, H, I] stacks: the
    loader fills the stacks, so the first pass never copies a layer's experts."""
    from tensorfold.ops.triton_moe import stack
    from tensorfold_glm.weights import MoeWeights

    path, _ = composite
    model = load(Checkpoint.open(path), "cpu", "float32")
    layers = [w.ffn for w in model.weights.layers if isinstance(w.ffn, MoeWeights)]
    assert layers
    for moe in layers:
        for part in ("gate_up", "down"):
            ws = [getattr(e, part) for e in moe.experts]
            stacked = stack(ws)
            assert stacked.data_ptr() == ws[0].data_ptr() and stacked._base is not None
            assert all(torch.equal(stacked[j], w) for j, w in enumerate(ws))
