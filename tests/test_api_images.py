"""Images through the API: chat image_url parts (data: URLs of each format, allowed http URLs)
become the `Request.media` the engine gets, within the limits; every bad image is a 400 naming
it, and leaves the requests beside it and the census intact.

The family is the lfm2_moe demo with a toy image processor (api_image_family.py); the requests
the engine gets are captured as they are submitted, and run (a model's tower is the lanes' part:
the demo model's `encode_media` here gives fixed rows).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import random
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from api_image_family import MOST_ROWS, PLACEHOLDER, ToyImages, image_demo, token_ids
from PIL import Image

from tensorfold.config.settings import Settings
from tensorfold.engine.requests import Request
from tensorfold.engine.start import Served, open_served
from tensorfold.family.media import MediaRefused, media_key
from tensorfold.server.app import create_app
from tensorfold.server.image_decode import MediaSource
from tensorfold.server.media_limits import MediaLimits
from tensorfold.server.prompt_workers import PromptWorkers
from tensorfold.server.request_limits import Limits

CHAT = "/v1/chat/completions"
LIMITS = MediaLimits(max_images=4, max_bytes=16 * 1024, max_pixels=96 * 96, fetch_timeout_s=2.0)
IDLE_POLLS = 400  # 50 ms each: the engine goes idle well within


def encoded(image: Image.Image, fmt: str, **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def chat(*parts: dict[str, Any], text: str = "What is this?") -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": text}]
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2}


def solid(size: tuple[int, int], color: tuple[int, ...], mode: str = "RGB") -> Image.Image:
    return Image.new(mode, size, color)


RED_PNG = data_url(encoded(solid((8, 8), (255, 0, 0)), "PNG"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = image_demo(tmp_path_factory.mktemp("images"))
    settings = Settings(memory_limit_gib=1, context=4096, parallel=2)
    s = open_served(settings, "lfm2_moe", folder)
    model = s.engine.lanes.runner.model
    hidden = int(s.checkpoint.config["hidden_size"])

    def encode_media(self: Any, pieces: Any) -> list[torch.Tensor]:  # fixed rows for a tower
        return [torch.full((p.rows, hidden), (p.key % 7) / 7.0) for p in pieces]

    # a class of its own, so that the engine sees a family with a tower
    model.__class__ = type("Pictured", (type(model),), {"encode_media": encode_media})
    plain = s.spec
    s.spec = dataclasses.replace(plain, hooks="api_image_family:hooks")
    s.plain_spec = plain  # type: ignore[attr-defined]
    yield s
    s.close()


@pytest.fixture
def seen(served: Served, monkeypatch: pytest.MonkeyPatch) -> list[Request]:
    """The requests the engine gets (each prompt's first choice), as they are submitted."""
    got: list[Request] = []
    submit = served.engine.submit_prompts

    def capture(*args: Any, **kwargs: Any) -> list[list[Request]]:
        groups = submit(*args, **kwargs)
        got.extend(group[0] for group in groups)
        return groups

    monkeypatch.setattr(served.engine, "submit_prompts", capture)
    return got


def app_of(served: Served, media: MediaLimits = LIMITS, **limits: Any) -> web.Application:
    return create_app(served, limits=Limits(media=media, **limits), access_log=False)


async def _post(client: TestClient, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    resp = await client.post(path, json=body)
    return resp.status, await resp.json()


def post(app: web.Application, *bodies: dict[str, Any], path: str = CHAT) -> list[tuple[int, Any]]:
    """The bodies sent at once; each one's status and JSON."""

    async def go() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            return list(await asyncio.gather(*(_post(client, path, b) for b in bodies)))

    return asyncio.run(go())


def even(served: Served) -> None:
    """The engine goes idle with its census even."""
    census = served.engine.lanes.pool.census()
    for _ in range(IDLE_POLLS):
        if census.idle_even:
            return
        time.sleep(0.05)
        census = served.engine.lanes.pool.census()
    raise AssertionError(census.line())


def check_pieces(served: Served, req: Request, sizes: list[tuple[int, int]]) -> None:
    """Each piece fills placeholder rows between two bounds, as the toy processor says."""
    ids = token_ids(Path(served.checkpoint.path))
    assert len(req.media) == len(sizes)
    for piece, (w, h) in zip(req.media, sizes):
        assert piece.rows == ToyImages.rows(w, h) <= MOST_ROWS
        assert req.prompt[piece.start : piece.end] == [ids[PLACEHOLDER]] * piece.rows
        assert req.prompt[piece.start - 1] == req.prompt[piece.end] == ids["<|endoftext|>"]
        assert piece.inputs[:2] == (w, h)


def test_data_urls_of_each_format_become_the_requests_media(
    served: Served, seen: list[Request]
) -> None:
    gif = encoded(
        solid((9, 9), (255, 0, 0)), "GIF", save_all=True, append_images=[solid((9, 9), (0, 0, 255))]
    )
    clear = encoded(solid((8, 16), (0, 0, 0, 0), "RGBA"), "PNG")  # transparent: over white
    parts = [
        data_url(encoded(solid((12, 8), (0, 128, 0)), "JPEG"), "image/jpeg"),
        data_url(encoded(solid((16, 16), (0, 0, 200)), "WEBP", lossless=True), "image/webp"),
        data_url(gif, "image/gif"),
        data_url(clear),
    ]
    [(status, reply)] = post(app_of(served), chat(*map(image_part, parts)))
    assert status == 200, reply
    [req] = seen
    check_pieces(served, req, [(12, 8), (16, 16), (9, 9), (8, 16)])
    webp, first_frame, white = req.media[1], req.media[2], req.media[3]
    assert webp.inputs[2] == (0, 0, 200) and first_frame.inputs[2] == (255, 0, 0)
    assert first_frame.key == media_key(solid((9, 9), (255, 0, 0)).tobytes(), 9, 9)
    assert white.key == media_key(solid((8, 16), (255, 255, 255)).tobytes(), 8, 16)
    assert len({p.key for p in req.media}) == 4
    assert reply["usage"]["prompt_tokens"] == len(req.prompt)  # the image rows counted
    even(served)


def test_the_same_pixels_key_alike_across_formats_and_turns_keep_their_marks(
    served: Served, seen: list[Request]
) -> None:
    red = solid((8, 8), (255, 0, 0))
    body = {
        "messages": [
            {"role": "user", "content": [image_part(RED_PNG), {"type": "text", "text": "a"}]},
            {"role": "assistant", "content": "red"},
            {"role": "user", "content": [image_part(data_url(encoded(red, "GIF"), "image/gif"))]},
        ],
        "max_tokens": 2,
    }
    replies = post(app_of(served), body, chat(text="no image"))
    assert [s for s, _ in replies] == [200, 200], replies
    [req] = [r for r in seen if r.media]
    [text_only] = [r for r in seen if r is not req]
    check_pieces(served, req, [(8, 8), (8, 8)])
    assert req.media[0].key == req.media[1].key == media_key(red.tobytes(), 8, 8)
    assert text_only.media == ()
    # each turn's mark is past its '<|im_end|>\n', wherever the images pushed it
    im_end = token_ids(Path(served.checkpoint.path))["<|im_end|>"]
    assert req.marks and all(req.prompt[m - 2] == im_end for m in req.marks)
    even(served)


def test_text_parts_alone_render_as_before(served: Served, seen: list[Request]) -> None:
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
    }
    joined = {"role": "user", "content": "a\nb"}
    statuses = post(
        app_of(served),
        {"messages": [parts], "max_tokens": 1},
        {"messages": [joined], "max_tokens": 1},
    )
    assert [s for s, _ in statuses] == [200, 200]
    assert seen[0].prompt == seen[1].prompt and seen[0].media == ()


def test_a_placeholder_typed_in_text_stays_text(served: Served, seen: list[Request]) -> None:
    [(status, reply)] = post(app_of(served), chat(image_part(RED_PNG), text=PLACEHOLDER * 3))
    assert status == 200, reply
    check_pieces(served, seen[0], [(8, 8)])  # one image's rows; the typed ones are text
    ids = token_ids(Path(served.checkpoint.path))
    assert seen[0].prompt.count(ids[PLACEHOLDER]) == seen[0].media[0].rows


def _bad(url: str) -> dict[str, Any]:
    return chat(image_part(url))


def bomb(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels and whose pixels are missing: refused
    from the header, or nothing would stop its decoding."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


NOISE = Image.frombytes("RGB", (90, 90), random.Random(0).randbytes(90 * 90 * 3))  # 24 KB PNG
TRUNCATED = data_url(encoded(solid((8, 8), (9, 9, 9)), "PNG")[:-30])  # its pixels cut
BAD = [
    (_bad(data_url(b"not an image at all")), "not an image Pillow reads"),
    (_bad(data_url(encoded(solid((4, 4), (1, 2, 3)), "BMP"), "image/bmp")), "BMP, a format not"),
    (_bad(TRUNCATED), "does not decode"),
    (_bad(data_url(encoded(NOISE, "PNG"))), "TF_MAX_IMAGE_MIB"),
    (_bad(data_url(encoded(solid((97, 96), (1, 1, 1)), "PNG"))), "TF_MAX_IMAGE_PIXELS"),
    (_bad(data_url(bomb(10_000, 10_000))), "10000 x 10000 = 100000000 pixels"),
    (_bad(data_url(bomb(100_000, 100_000))), "too large to decode"),  # past Pillow's own
    (chat(*[image_part(RED_PNG)] * 5), "TF_MAX_IMAGES"),
    (_bad("https://example.com/cat.png"), "host 'example.com' is not one"),
    (_bad("ftp://example.com/cat.png"), "scheme 'ftp' are not taken"),
    (_bad("data:image/png,rawbytes"), "must be base64"),
    (_bad("data:image/png;base64,@@@@"), "base64 does not decode"),
    (chat({"type": "image_url", "image_url": {"url": RED_PNG, "detail": "max"}}), "detail"),
    (chat({"type": "input_audio", "input_audio": {}}), "input_audio must be an object"),
    (  # a well-formed clip, and the family has no audio tower
        chat({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
        "family (this checkpoint) takes no audio",
    ),
    (  # an image the template does not place (the demo's assistant turns print content)
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [image_part(RED_PNG)]},
            ]
        },
        "placed 0 image(s)",
    ),
]


@pytest.mark.parametrize("body, words", BAD, ids=[w for _, w in BAD])
def test_a_bad_image_is_a_400_naming_it(served: Served, body: dict[str, Any], words: str) -> None:
    [(status, reply)] = post(app_of(served), body)
    assert status == 400 and reply["error"]["param"] == "messages", reply
    assert words in reply["error"]["message"], reply


def test_a_bad_request_amid_good_ones_leaves_them_and_the_census(
    served: Served, seen: list[Request]
) -> None:
    good = chat(image_part(RED_PNG))
    bad = _bad(data_url(b"\x89PNG\r\n\x1a\n broken"))
    replies = post(app_of(served), good, bad, good, chat(text="plain"))
    assert [s for s, _ in replies] == [200, 400, 200, 200], replies
    imaged = [r for r in seen if r.media]
    assert len(seen) == 3 and len(imaged) == 2
    assert imaged[0].prompt == imaged[1].prompt and imaged[0].media[0].key == imaged[1].media[0].key
    even(served)


def test_image_parts_on_completions_and_tokenize_are_refused(served: Served) -> None:
    app = app_of(served)
    [(status, reply)] = post(app, {"prompt": [image_part(RED_PNG)]}, path="/v1/completions")
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert "/v1/completions takes no images" in reply["error"]["message"]
    [(status, reply)] = post(app_of(served), chat(image_part(RED_PNG)), path="/tokenize")
    assert status == 400 and "takes no images" in reply["error"]["message"]


def test_a_family_without_a_tower_says_so_and_models_say_what_each_takes(
    served: Served,
) -> None:
    plain = dataclasses.replace(served, spec=served.plain_spec)  # type: ignore[attr-defined]
    [(status, reply)] = post(app_of(plain), chat(image_part(RED_PNG)))
    assert status == 400 and reply["error"]["param"] == "messages"
    assert "the lfm2_moe family takes no images" in reply["error"]["message"]

    async def card(app: web.Application) -> dict[str, Any]:
        async with TestClient(TestServer(app)) as client:
            return (await (await client.get("/v1/models")).json())["data"][0]

    text = asyncio.run(card(app_of(plain)))
    assert text["capabilities"] == ["completion"] and text["input_modalities"] == ["text"]
    vision = asyncio.run(card(app_of(served)))
    assert vision["capabilities"] == ["completion", "vision"]
    assert vision["input_modalities"] == ["text", "image"]


def test_responses_input_image_takes_the_same_path(served: Served, seen: list[Request]) -> None:
    content = [
        {"type": "input_image", "image_url": RED_PNG, "detail": "auto"},
        {"type": "input_text", "text": "What is it?"},
    ]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 2}
    [(status, reply)] = post(app_of(served), body, path="/v1/responses")
    assert status == 200, reply
    check_pieces(served, seen[0], [(8, 8)])
    assert reply["usage"]["input_tokens"] == len(seen[0].prompt)
    body["input"][0]["content"][0] = {"type": "input_image", "file_id": "file-1"}
    [(status, reply)] = post(app_of(served), body, path="/v1/responses")
    assert status == 400 and "file_id is not supported" in reply["error"]["message"]


def test_a_prompt_worker_process_prepares_the_images(served: Served, seen: list[Request]) -> None:
    workers = PromptWorkers(served.tokenizer, 1, MediaSource.of(served.spec, served.checkpoint))
    workers.start()
    try:
        app = app_of(served, prompts=workers)
        replies = post(app, chat(image_part(RED_PNG)), _bad(TRUNCATED))
    finally:
        workers.close()
    assert [s for s, _ in replies] == [200, 400], replies
    assert "does not decode" in replies[1][1]["error"]["message"]
    check_pieces(served, seen[0], [(8, 8)])
    assert seen[0].media[0].inputs == (8, 8, (255, 0, 0))
    even(served)


def _image_site(release: asyncio.Event) -> web.Application:
    """A local site: /red.png, /big.png (past the byte limit), /slow.png (past the time
    limit: it answers once `release` is set), /away (a redirect to a host not listed), /here
    (a redirect to /red.png)."""
    red = encoded(solid((8, 8), (255, 0, 0)), "PNG")

    async def png(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name == "slow":
            await release.wait()
        body = encoded(NOISE, "PNG") if name == "big" else red
        return web.Response(body=body, content_type="image/png")

    async def away(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"http://localhost:{request.url.port}/red.png")

    async def here(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/red.png")

    site = web.Application()
    site.router.add_get("/{name}.png", png)
    site.router.add_get("/away", away)
    site.router.add_get("/here", here)
    return site


def test_image_urls_are_fetched_only_from_listed_hosts(served: Served, seen: list[Request]) -> None:
    async def go() -> list[tuple[int, Any]]:
        release = asyncio.Event()
        async with TestServer(_image_site(release), host="127.0.0.1") as site:
            base = f"http://127.0.0.1:{site.port}"
            listed = dataclasses.replace(
                LIMITS, allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5
            )
            out = []
            for media, path in [
                (listed, "/red.png"),
                (listed, "/here"),
                (LIMITS, "/red.png"),
                (listed, "/away"),
                (listed, "/big.png"),
                (listed, "/slow.png"),
                (listed, "/nothing"),
            ]:
                async with TestClient(TestServer(app_of(served, media))) as client:
                    out.append(await _post(client, CHAT, _bad(base + path)))
            release.set()
            return out

    replies = asyncio.run(go())
    assert [s for s, _ in replies] == [200, 200, 400, 400, 400, 400, 400], replies
    words = ["not one the server may fetch", "redirects to", "TF_MAX_IMAGE_MIB", "TF_MEDIA_FETCH"]
    for (_, reply), said in zip(replies[2:], [*words, "HTTP 404"]):
        assert said in reply["error"]["message"], reply
    check_pieces(served, seen[0], [(8, 8)])
    assert seen[0].media[0].key == seen[1].media[0].key
    even(served)


def test_the_offline_api_takes_the_same_parts(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tensorfold.llm import LLM

    llm = LLM.__new__(LLM)
    llm.settings, llm.served, llm.tokenizer = Settings(max_images=2), served, served.tokenizer
    got: list[Any] = []
    submit = served.engine.submit_n
    monkeypatch.setattr(
        served.engine, "submit_n", lambda *a, **k: got.append(k["media"]) or submit(*a, **k)
    )
    [done] = llm.chat([chat(image_part(RED_PNG))["messages"]])
    assert done.finish_reason in ("stop", "length") and len(got[0]) == 1
    assert got[0][0].key == media_key(solid((8, 8), (255, 0, 0)).tobytes(), 8, 8)
    with pytest.raises(MediaRefused, match="TF_MAX_IMAGES"):
        llm.chat([chat(*[image_part(RED_PNG)] * 3)["messages"]])
    even(served)


def test_generate_image_flag_makes_a_user_turn_of_parts(tmp_path: Path) -> None:
    from tensorfold.cli.commands import CommandError
    from tensorfold.cli.generate import image_part as file_part
    from tensorfold.cli.generate import user_turn

    path = tmp_path / "red.png"
    path.write_bytes(encoded(solid((8, 8), (255, 0, 0)), "PNG"))
    part = file_part(str(path))
    assert part["image_url"]["url"] == data_url(path.read_bytes())
    turn = user_turn("What is it?", [part])
    assert turn["content"] == [part, {"type": "text", "text": "What is it?"}]
    assert user_turn("hi", []) == {"role": "user", "content": "hi"}
    with pytest.raises(CommandError, match="--image"):
        file_part(str(tmp_path / "missing.png"))
    assert file_part("https://example.com/a.png")["image_url"] == {
        "url": "https://example.com/a.png"
    }


def test_generate_image_on_a_family_without_a_tower_is_an_error_naming_it(
    tf_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tensorfold.cli import commands
    from tensorfold.family.plugins import reset_plugin_manager

    tf_env.setenv("TF_DEMO_CACHE", str(tmp_path))
    reset_plugin_manager()
    path = tmp_path / "red.png"
    path.write_bytes(encoded(solid((8, 8), (255, 0, 0)), "PNG"))
    ask = ["generate", "--family", "lfm2_moe", "--context", "1024", "--max-tokens", "2", "hi"]
    assert commands.main([*ask, "--image", str(path)]) == 2
    assert "the lfm2_moe family takes no images" in capsys.readouterr().err
