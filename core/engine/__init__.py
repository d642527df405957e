"""The engine: requests in, tokens out. start opens a model (settings -> family -> checkpoint
-> plan -> weights -> lanes); the engine thread (engine) runs the lanes' rounds (lanes) on the
model over the pool (runner, cuda_graphs, tensor_parallel), samples (sampling, choices,
structured) and stops (stops).

Importing the package loads nothing; `tensorfold.engine.engine.Engine` is engine.Engine."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # engine.py loads torch: only when asked for
    if name in ("Engine", "QueueFull"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'tensorfold.engine' has no attribute {name!r}")
