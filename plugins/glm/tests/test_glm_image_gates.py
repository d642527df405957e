"""glm5_next image chats through the engine (tensorfold.LLM), on the vision demo checkpoint in
fp32 on the CPU: concurrent == solo with image chats among text ones, resumed == fresh with an
image in the kept prefix (and a different image never a hit), drafted (the MTP layer) == plain,
the census even after each engine.

It needs the engine's media path (the lanes' `tensorfold.engine.media_rows`) and the chat
API's images (`tensorfold.server.image_decode`), built beside this family for issue 59; until
both are installed it is skipped."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import pytest

from tensorfold import testing
from tensorfold.engine.sampling import SamplingParams

pytest.importorskip("tensorfold.engine.media_rows", reason="the engine's media path (issue 59)")
pytest.importorskip("tensorfold.server.image_decode", reason="the chat API's images (issue 59)")
Image = pytest.importorskip("PIL.Image")

SAMPLED = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)
QUESTION = "What is in the picture? " * 30  # past the demo's 64-row marks, so a turn is kept


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tensorfold_glm.vision_demo import write_vision_demo

    return write_vision_demo(tmp_path_factory.mktemp("glm_image_gates") / "ckpt")


def data_url(image: Any) -> str:
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_chat(image: Any, text: str = QUESTION) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def pictures(folder: Path) -> tuple[Any, Any]:
    return Image.open(folder / "sample.png"), Image.new("RGB", (200, 130), (30, 160, 90))


def tokens(llm: Any, chats: list[list[dict[str, Any]]]) -> list[list[int]]:
    return [c.token_ids for c in llm.chat(chats, SAMPLED)]


def test_image_chats_among_text_chats_equal_alone_and_drafted(folder: Path) -> None:
    first, second = pictures(folder)
    chats = [
        image_chat(first),
        [{"role": "user", "content": "Tell me a story."}],
        image_chat(second, "And this one?"),
    ]
    llm = testing.open_llm("glm5_next", folder, context=1024, parallel=3)
    try:
        together = tokens(llm, chats)
        assert together == [tokens(llm, [c])[0] for c in chats]
        assert together[0] != tokens(llm, [image_chat(second)])[0]  # the image is read
    finally:
        testing.close_even(llm)
    llm = testing.open_llm("glm5_next", folder, context=1024, parallel=3, draft="mtp")
    try:
        assert tokens(llm, chats) == together
    finally:
        testing.close_even(llm)


def test_a_resumed_image_chat_equals_a_fresh_one(folder: Path) -> None:
    first, second = pictures(folder)

    def second_turn(llm: Any, image: Any) -> tuple[list[int], int]:
        chat = image_chat(image)
        reply = llm.chat([chat], SAMPLED)[0]
        turn = chat + [
            {"role": "assistant", "content": reply.text},
            {"role": "user", "content": "More?"},
        ]
        done = llm.chat([turn], SAMPLED)[0]
        return done.token_ids, done.cached_tokens

    fresh = testing.open_llm("glm5_next", folder, context=1024)
    try:
        want, cached = second_turn(fresh, first)
        assert cached == 0
    finally:
        testing.close_even(fresh)
    kept = testing.open_llm("glm5_next", folder, context=1024, kv_share=16, prompt_cache_gib=0.05)
    try:
        got, cached = second_turn(kept, first)
        assert got == want and cached >= 64  # the kept prefix holds the image's rows
        # the same words about another image: no hit past the rows before the image
        other = kept.chat([image_chat(second)], SAMPLED)[0]
        assert other.cached_tokens < 64
    finally:
        testing.close_even(kept)
