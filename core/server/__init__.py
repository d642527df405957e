"""The HTTP server (aiohttp): the app and its routes (app), OpenAI bodies in and out
(openai_api, openai_replies, request_checks, tool_request), limits and connections, CORS and
the API key, the prompt workers, the status page (status_page, status_feed, status/), shutdown
and metrics.

Importing the package loads nothing (the prompt workers import prompt_work from it, without
torch); `tensorfold.server.create_app` is app.create_app."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:  # the app loads the engine: only when asked for
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module 'tensorfold.server' has no attribute {name!r}")
