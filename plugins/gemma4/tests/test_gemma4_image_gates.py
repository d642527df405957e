"""gemma4 image chats through the engine (tensorfold.LLM), on the vision demo checkpoint in fp32
on the CPU, its image rows attending both ways in the sliding layers: the gates with images
(`testing.assert_image_chat_gates`: concurrent == solo among text chats, drafted == plain,
resumed == fresh with an image in the kept prefix and a different image never a hit, the census
even)."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
QUESTION = "What is in the picture? " * 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensorfold_gemma4.vision_demo import write_vision_demo

    return write_vision_demo(tmp_path_factory.mktemp("gemma4_image_gates") / "ckpt")


def test_image_chats_hold_the_gates(folder: Path) -> None:
    stripes = Image.new("RGB", (96, 64), (200, 40, 40))
    stripes.paste((20, 20, 220), (0, 0, 96, 20))
    images = (stripes, Image.new("RGB", (64, 80), (30, 160, 90)))
    testing.assert_image_chat_gates(
        "gemma4", folder, images, SAMPLED, QUESTION, kept_rows=64, context=1024
    )
