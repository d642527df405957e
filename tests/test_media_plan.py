"""The memory plan sets a media tower's activations (ModelShape.media_bytes) aside on CUDA, with
the activation reserve, and keeps them when tensor parallel swaps in a shard's layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tensorfold.config.settings import Settings
from tensorfold.engine import start
from tensorfold.family import ModelShape, RowSpec, StateLayout, StateSpec

SHAPE = ModelShape(
    StateLayout(paged=(RowSpec("k", (2, 64)),), fixed=(StateSpec("s", (64,)),)), 1 << 16
)


def test_media_bytes_come_out_of_the_room_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
    settings = Settings(parallel=1, cuda_graphs=False)
    plain = start._room(settings, SHAPE, "cuda:0", 0)
    tower = start._room(settings, dataclasses.replace(SHAPE, media_bytes=3 << 30), "cuda:0", 0)
    assert plain - tower == 3 << 30
    assert SHAPE.media_bytes == 0  # a family without a tower sets nothing aside
