"""gemma4's audio tower (audio.py) against transformers 5.23.0's `get_audio_features` on a tiny
Gemma4ForConditionalGeneration with an audio_config, saved and loaded back: 1 and 2 clips of
different lengths, fp32, <= 1e-4 relative. The reference runs the clips as one padded batch;
its valid rows (its output mask) are compared with each clip run alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gemma4_media_configs import MEDIA_IDS, TINY_TEXT

from tensorfold.family.checkpoint import Checkpoint
from tensorfold_gemma4.audio import audio_embeddings
from tensorfold_gemma4.audio_config import audio_config
from tensorfold_gemma4.audio_features import audio_soft_tokens
from tensorfold_gemma4.config import ConfigError
from tensorfold_gemma4.model import load

MEL = 16  # mel bins; the tower's width after subsampling is (C0 // 4)·C1, so C0 = MEL
FRAMES = (61, 30)  # two clips: 16 and 8 soft tokens, chunked attention over several chunks


def _reference(folder: Path) -> Any:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(TINY_TEXT)
    audio = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        subsampling_conv_channels=[MEL, 4],
        output_proj_dims=24,
        attention_chunk_size=4,
        attention_context_left=5,
        attention_context_right=2,
        attention_logit_cap=5.0,  # low enough to bend the tiny model's logits
    )
    torch.manual_seed(5)
    ref = Gemma4ForConditionalGeneration(
        Gemma4Config(
            text_config=text,
            vision_config=None,
            audio_config=audio,
            **MEDIA_IDS,
        )
    ).eval()
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():  # ones-, zero-initialised and unbounded tensors made non-trivial
        for name, p in ref.model.audio_tower.named_parameters():
            if "norm" in name or "per_dim_scale" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            elif p.ndim >= 2:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        for name, b in ref.model.audio_tower.named_buffers():
            if name.endswith(("input_min", "output_min")):
                b.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                b.fill_(1.5)
    ref.save_pretrained(folder)
    return ref


def _features(frames: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel-like features [B, max frames, MEL] (zero padding) and their mask [B, frames]."""
    gen = torch.Generator().manual_seed(7)
    feats = torch.zeros(len(frames), max(frames), MEL)
    mask = torch.zeros(len(frames), max(frames), dtype=torch.bool)
    for i, n in enumerate(frames):
        feats[i, :n] = torch.randn(n, MEL, generator=gen)
        mask[i, :n] = True
    return feats, mask


@pytest.fixture(scope="module")
def tower(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    folder = tmp_path_factory.mktemp("gemma4_audio")
    ref = _reference(folder)
    return ref, load(Checkpoint.open(folder), "cpu", "float32")


def _ours(model: Any, frames: tuple[int, ...]) -> torch.Tensor:
    feats, _ = _features(frames)
    return torch.cat(
        [
            audio_embeddings(model.audio_cfg, model.audio_weights, f[:n])
            for f, n in zip(feats, frames)
        ]
    )


@pytest.mark.parametrize("frames", [FRAMES[:1], FRAMES], ids=["one_clip", "two_clips"])
def test_soft_tokens_match_the_reference(tower: tuple[Any, Any], frames: Any) -> None:
    ref, model = tower
    feats, mask = _features(frames)
    with torch.no_grad():
        out = ref.model.get_audio_features(feats, mask)
        want = out.pooler_output[out.attention_mask]
        got = _ours(model, frames)
    rows = sum(audio_soft_tokens(n) for n in frames)
    assert got.shape == want.shape == (rows, 64)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_the_comparison_sees_a_wrong_window(tower: tuple[Any, Any]) -> None:
    """The parity bound fails when the tower's local window is off by one frame: the test can
    tell the reference's attention from a near miss."""
    ref, model = tower
    feats, mask = _features(FRAMES)
    cfg = model.audio_cfg
    wrong = type(cfg)(**{**cfg.__dict__, "attention_context_left": cfg.attention_context_left + 1})
    with torch.no_grad():
        out = ref.model.get_audio_features(feats, mask)
        want = out.pooler_output[out.attention_mask]
        got = torch.cat(
            [audio_embeddings(wrong, model.audio_weights, f[:n]) for f, n in zip(feats, FRAMES)]
        )
    assert ((got - want).abs().max() / want.abs().max()).item() > 1e-3


def test_a_clip_s_tokens_do_not_depend_on_others(tower: tuple[Any, Any]) -> None:
    _, model = tower
    both = _ours(model, FRAMES)
    first = _ours(model, FRAMES[:1])
    assert torch.equal(both[: len(first)], first)


def test_audio_config_refusals() -> None:
    text = {"hidden_size": 64}
    assert audio_config({"text_config": text}) is None
    with pytest.raises(ConfigError, match="hidden_act"):
        audio_config({"text_config": text, "audio_config": {"hidden_act": "gelu"}})
    with pytest.raises(ConfigError, match="multiple of num_attention_heads"):
        audio_config({"text_config": text, "audio_config": {"hidden_size": 30}})
    with pytest.raises(ConfigError, match="subsampling_conv_channels"):
        audio_config({"text_config": text, "audio_config": {"subsampling_conv_channels": [8]}})
    with pytest.raises(ConfigError, match="text_config"):
        audio_config({"audio_config": {}})
    cfg = audio_config({"text_config": text, "audio_config": {}})
    assert cfg is not None and (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (
        1024,
        12,
        128,
    )
    assert cfg.context_size == 24 and cfg.output_proj_dims == 1536


def test_a_text_only_checkpoint_has_no_audio_tower(tiny_paths: dict[str, Path]) -> None:
    model = load(Checkpoint.open(tiny_paths["e_style"]), "cpu", "float32")
    assert model.audio_cfg is None and model.audio_weights is None
