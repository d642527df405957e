"""A toy image family for the API's image tests: the lfm2_moe demo checkpoint with a chat template
that writes `<|pad|>` for each image item, and a `media_processor` hook (`hooks`) answering a
small MediaProcessor: an image fills 1 + its pixels // 64 rows (at most 6) between two
`<|endoftext|>` tokens; its inputs are plain numbers (they pickle), so a prompt worker can send
them back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import tensorfold

PLACEHOLDER = "<|pad|>"
BOUND = "<|endoftext|>"
MOST_ROWS = 6
# The demo template's user / system branch, and the same branch that renders content items.
PLAIN_CONTENT = "{{- message.get('content') or '' -}}"
ITEM_CONTENT = (
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '" + PLACEHOLDER + "' -}}"
    "{%- else -%}{{- item['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
)


def image_demo(folder: Path) -> Path:
    """The lfm2_moe demo checkpoint with ITEM_CONTENT in its chat template."""
    from tensorfold_lfm2_moe.demo import build_demo

    built = build_demo(folder / "cache")
    demo = folder / "image-demo"
    shutil.copytree(built, demo)
    config_path = demo / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert PLAIN_CONTENT in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace(PLAIN_CONTENT, ITEM_CONTENT)
    config_path.write_text(json.dumps(config))
    return demo


def token_ids(folder: Path) -> dict[str, int]:
    added = json.loads((folder / "tokenizer.json").read_text())["added_tokens"]
    return {token["content"]: token["id"] for token in added}


class ToyImages:
    """A MediaProcessor (tensorfold.family.media) for the toy family."""

    kinds = frozenset({"image"})
    placeholder = PLACEHOLDER
    block = False

    def __init__(self, placeholder_id: int, bound_id: int) -> None:
        self.placeholder_id = placeholder_id
        self.bound_id = bound_id

    @staticmethod
    def rows(width: int, height: int) -> int:
        return min(MOST_ROWS, 1 + width * height // 64)

    def prepare_image(self, image: Any) -> tuple[Any, int]:
        return (image.width, image.height, image.getpixel((0, 0))), self.rows(*image.size)

    def image_ids(self, rows: int) -> tuple[list[int], int]:
        return [self.bound_id, *[self.placeholder_id] * rows, self.bound_id], 1


class Hooks:
    @tensorfold.hookimpl
    def media_processor(self, folder: Path | None, config: Mapping[str, Any]) -> ToyImages:
        assert folder is not None
        ids = token_ids(folder)
        return ToyImages(ids[PLACEHOLDER], ids[BOUND])


hooks = Hooks()
