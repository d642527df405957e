"""tensorfold: serve large language models from Python."""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("tensorfold")

__all__ = ["__version__", "hookimpl"]
