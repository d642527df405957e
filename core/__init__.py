"""tensorfold: serve large language models from Python.

docs/architecture.md has a request's path through these modules, the module map and the
exactness rules; docs/plugins.md and docs/reference.md are for family authors."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tensorfold")

__all__ = ["__version__", "hookimpl", "LLM", "SamplingParams"]


def __getattr__(name: str):  # the offline API loads torch, so only when asked for
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tensorfold' has no attribute {name!r}")
