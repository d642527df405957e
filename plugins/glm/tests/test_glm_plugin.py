"""The plugin's registrations, the state layout at GLM-5.3-Flash's real shape (from config.json
alone), and the retired TF_GLM_KV_SHARE: refused before the weights load, naming TF_KV_SHARE,
unless it is 0 or empty."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tensorfold.config.settings import Settings, SettingsError, check_environment
from tensorfold.family import FamilySpec, resolve
from tensorfold.family.plugins import get_plugin_manager
from tensorfold.family.profiles import collect_rows
from tensorfold_glm import plugin
from tensorfold_glm.layout import shape
from tensorfold_glm.model import load

MiB = 2**20


def test_plugin_registers_the_family_and_its_retired_row() -> None:
    found: list[FamilySpec] = []
    plugin.register_families(found.append)
    (spec,) = found
    assert spec.name == "glm5_next"
    assert resolve(spec.load) is load
    assert resolve(spec.shape) is shape
    assert callable(resolve(spec.build_demo))
    rows: list = []
    plugin.profile_rows(rows.append)
    (row,) = rows
    assert row.setting == "TF_GLM_KV_SHARE" and row.replaced_by == "TF_KV_SHARE"
    assert row.families == ("glm5_next",)


@pytest.mark.parametrize("config", [{}, {"model_type": "glm5_next", "text_config": {}}])
def test_state_layout_at_the_real_shape(config: dict) -> None:
    """At the class defaults, 34 KDA layers keep an fp32 [64, 128, 128] state and a 3-column conv
    tail of 3 * 64 * 128 bf16 channels (140.8 MiB a stream); 11 MLA layers page a 512-wide
    latent and the indexer's 128-wide key, gate and pool-key rows (19.25 KiB a token)."""
    layout = shape(config, "bfloat16").layout
    kda, mla = 34, 11
    state = 64 * 128 * 128 * 4
    tail = 3 * 64 * 128 * (4 - 1) * 2
    assert len(layout.fixed) == 2 * kda
    assert layout.fixed_bytes == kda * (state + tail) == 147_619_840
    assert round(layout.fixed_bytes / MiB, 1) == 140.8
    assert len(layout.paged) == 4 * mla
    assert layout.row_bytes == mla * (512 + 3 * 128) * 2 == 19_712
    assert layout.page_bytes(512) == 9.625 * MiB
    assert layout.mark_rows == 64  # lcm(the KDA chunk 64, index_kpool 16)
    assert shape(config, "bfloat16").max_positions == 1_048_576


def test_layout_names_each_layers_rows_and_state(tiny_paths: dict[str, Path]) -> None:
    import json

    cfg = json.loads((tiny_paths["glm_tiny"] / "config.json").read_text())
    layout = shape(cfg, "float32").layout
    assert [(r.name, r.shape) for r in layout.paged] == [
        ("L1.latent", (16,)),
        ("L1.index_k", (16,)),
        ("L1.index_gate", (16,)),
        ("L1.pool_key", (16,)),
        ("L2.latent", (16,)),  # layer 2 shares layer 1's selection: no indexer rows
    ]
    assert [(s.name, s.shape, s.dtype) for s in layout.fixed] == [
        ("L0.kda", (2, 16, 16), "float32"),
        ("L0.conv", (96, 3), "float32"),
        ("L3.kda", (2, 16, 16), "float32"),
        ("L3.conv", (96, 3), "float32"),
    ]
    assert layout.mark_rows == 64  # lcm(the KDA chunk 64, index_kpool 4)


@pytest.mark.parametrize("value, refused", [("4", True), ("on", True), ("0", False), ("", False)])
def test_retired_setting_through_the_core_check(
    monkeypatch: pytest.MonkeyPatch, value: str, refused: bool
) -> None:
    monkeypatch.setenv("TF_GLM_KV_SHARE", value)
    settings = Settings()
    rows = collect_rows(get_plugin_manager(settings))
    assert any(r.setting == "TF_GLM_KV_SHARE" for r in rows)
    if refused:
        with pytest.raises(
            SettingsError,
            match=f"TF_GLM_KV_SHARE is retired; use TF_KV_SHARE.*TF_GLM_KV_SHARE={value}",
        ):
            check_environment(settings, rows)
    else:
        assert check_environment(settings, rows) == []  # known, so not even "unknown"


def _generate(tmp_path: Path, value: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_")}
    env.update(TF_GLM_KV_SHARE=value, TF_DEMO_CACHE=str(tmp_path / "demo"))
    command = [
        sys.executable,
        "-m",
        "tensorfold.cli",
        "generate",
        "--family",
        "glm5_next",
        "--context",
        "1024",
        "--max-tokens",
        "3",
        "Hello",
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value", ["4", "0"])
def test_retired_setting_through_tensorfold_generate(tmp_path: Path, value: str) -> None:
    done = _generate(tmp_path, value)
    if value == "4":
        assert done.returncode != 0
        assert "TF_GLM_KV_SHARE is retired; use TF_KV_SHARE" in done.stderr
        assert not (tmp_path / "demo").exists()  # refused before any checkpoint was touched
    else:
        assert done.returncode == 0, done.stderr
        assert "'Hello' -> " in done.stdout
