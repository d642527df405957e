"""A tiny image-taking glm5_next checkpoint in a folder of one's choosing, for end-to-end runs on
the CPU: the demo checkpoint (demo.py: a one-block random vision tower, the tokenizer's image
tokens, a chat template that places `{"type": "image"}` parts, a preprocessor_config.json), and
a small PNG beside it to send.

    python -m tensorfold_glm.vision_demo DIR
    tensorfold serve --family glm5_next --model DIR

No transformers, no download; the same bytes on every build.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

from .demo import write_demo

__all__ = ["write_vision_demo", "sample_png", "SAMPLE"]

SAMPLE = "sample.png"  # written beside the checkpoint's files (the checkpoint ignores it)


def sample_png(width: int = 96, height: int = 64) -> bytes:
    """An RGB PNG of a colour gradient, built with zlib alone (no Pillow needed to write it)."""
    rows = b"".join(
        b"\x00" + bytes(v for x in range(width) for v in (x * 255 // width, y * 255 // height, 96))
        for y in range(height)
    )

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return len(data).to_bytes(4, "big") + body + zlib.crc32(body).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + b"\x08\x02\x00\x00\x00"
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(rows, 9))
        + chunk(b"IEND", b"")
    )


def write_vision_demo(folder: Path) -> Path:
    """Write the checkpoint and SAMPLE into `folder` (created; it must be empty)."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise FileExistsError(f"{folder} is not empty")
    write_demo(folder)
    (folder / SAMPLE).write_bytes(sample_png())
    return folder


if __name__ == "__main__":  # pragma: no cover - a command for people
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tensorfold_glm.vision_demo DIR")
    out = write_vision_demo(Path(sys.argv[1]))
    print(f"wrote {out}; serve it with: tensorfold serve --family glm5_next --model {out}")
