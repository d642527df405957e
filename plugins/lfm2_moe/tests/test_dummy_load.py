"""TF_LOAD_FORMAT=dummy: a checkpoint folder with no weights serves the config's shape with
random weights from a fixed seed (for benchmarks), through the same lanes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tensorfold.engine.sampling import SamplingParams
from tensorfold.family.checkpoint import CheckpointError
from tensorfold.llm import LLM
from tensorfold.testing import close_even
from tensorfold_lfm2_moe.demo import build_demo


def configs_only(demo: Path, to: Path) -> Path:
    to.mkdir()
    for f in demo.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, to / f.name)
    return to


def test_dummy_weights_serve_a_folder_without_weights(tmp_path: Path) -> None:
    folder = configs_only(build_demo(tmp_path / "demo"), tmp_path / "configs")
    with pytest.raises(CheckpointError):
        LLM(family="lfm2_moe", model=folder, device="cpu", dtype="float32", memory_limit_gib=0.25)
    flags = dict(
        device="cpu",
        dtype="float32",
        memory_limit_gib=0.25,
        load_format="dummy",
        context=2048,
        parallel=2,
    )
    outputs = []
    for _ in range(2):  # the same seed twice: the same weights, the same tokens
        llm = LLM(family="lfm2_moe", model=folder, **flags)
        try:
            assert llm.served.model_name == str(folder)
            done = llm.generate(
                [[5, 6, 7, 8], [9] * 30], SamplingParams(temperature=0, max_tokens=6)
            )
            outputs.append([c.token_ids for c in done])
            assert all(len(c.token_ids) == 6 for c in done)
        finally:
            close_even(llm)
    assert outputs[0] == outputs[1]
    assert json.loads((folder / "config.json").read_text())["model_type"] == "lfm2_moe"
