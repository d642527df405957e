"""glm5_next image chats through the engine (tensorfold.LLM), on the vision demo checkpoint in
fp32 on the CPU: the gates with images (`testing.assert_image_chat_gates`: concurrent == solo
among text chats, drafted == plain, resumed == fresh with an image in the kept prefix and a
different image never a hit, the census even), and drafted by the MTP layer == plain."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
QUESTION = "What is in the picture? " * 30  # past the demo's 64-row marks, so a turn is kept


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensorfold_glm.vision_demo import write_vision_demo

    return write_vision_demo(tmp_path_factory.mktemp("glm_image_gates") / "ckpt")


def test_image_chats_hold_the_gates_and_mtp_drafts_change_nothing(folder: Path) -> None:
    images = (Image.open(folder / "sample.png"), Image.new("RGB", (200, 130), (30, 160, 90)))
    together = testing.assert_image_chat_gates(
        "glm5_next", folder, images, SAMPLED, QUESTION, kept_rows=64, context=1024
    )
    chats = [
        testing.image_chat(images[0], QUESTION),
        [{"role": "user", "content": "Tell me a story."}],
        testing.image_chat(images[1], "And this one?"),
    ]
    llm = testing.open_llm("glm5_next", folder, context=1024, parallel=3, draft="mtp")
    try:
        assert [c.token_ids for c in llm.chat(chats, SAMPLED)] == together
    finally:
        testing.close_even(llm)
