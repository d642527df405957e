"""The code blocks of a markdown guide that carry a file name (```python file=path) or are marked
to be checked (```python check), for the tests that run a guide's code
(tests/test_plugin_guide.py)."""

from __future__ import annotations

import re
from pathlib import Path

FENCE = re.compile(r"^```(\w+) file=(\S+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
CHECK = re.compile(r"^```python check\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def file_blocks(markdown: str) -> dict[str, str]:
    """{relative path: contents} of every fenced block with a file name, in order. A path named
    twice, or one that leaves the folder it is written into, raises."""
    files: dict[str, str] = {}
    for _lang, path, body in FENCE.findall(markdown):
        if path in files:
            raise ValueError(f"{path} is written by two blocks")
        if path.startswith("/") or ".." in Path(path).parts:
            raise ValueError(f"{path} leaves the guide's folder")
        files[path] = body
    return files


def check_blocks(markdown: str) -> list[str]:
    """The snippets marked ```python check: code that must run as written."""
    return CHECK.findall(markdown)


def write_blocks(markdown: str, root: Path) -> dict[str, Path]:
    """Write the guide's file blocks under root; returns {relative path: written file}."""
    written = {}
    for rel, body in file_blocks(markdown).items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(body, encoding="utf-8")
        written[rel] = target
    return written
