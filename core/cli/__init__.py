"""The command line `tensorfold`: the parser and its commands (commands), `serve`, `generate`,
`bench` and `exact`. `python -m tensorfold.cli` runs it; `tensorfold.cli.commands.main` is
commands.main."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "main":
        from .commands import main

        return main
    raise AttributeError(f"module 'tensorfold.cli' has no attribute {name!r}")
