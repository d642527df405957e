"""structlog set-up: readable lines on a terminal, one JSON object a line with --log-format json.

Log lines go to stderr, so that command output on stdout (`tensorfold profiles --markdown`)
stays clean.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
_configured: tuple[str, str] | None = None


class _NamedPrintLogger(structlog.PrintLogger):
    def __init__(self, name: str) -> None:
        # sys.stderr as it is now: loggers are made per call, and pytest swaps stderr per test.
        super().__init__(sys.stderr)
        self.name = name


def _logger_factory(*args: Any) -> _NamedPrintLogger:
    return _NamedPrintLogger(str(args[0]) if args else "")


def _add_logger_name(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    name = getattr(logger, "name", "")
    if name:
        event.setdefault("logger", name)
    return event


def configure_logging(fmt: str = "console", level: str = "info") -> None:
    """Configure structlog for the whole process. Calling it again with the same arguments
    does nothing; with other arguments it replaces the configuration (the last call wins)."""
    global _configured
    if _configured == (fmt, level):
        return
    if fmt not in ("console", "json"):
        raise ValueError(f"log format must be console or json, got {fmt!r}")
    level_no = _LEVELS.get(level.lower())
    if level_no is None:
        raise ValueError(f"unknown log level {level!r}")
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        _add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=fmt == "json"),
    ]
    if fmt == "json":
        processors += [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    else:
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level_no),
        logger_factory=_logger_factory,
        cache_logger_on_first_use=False,
    )
    _configured = (fmt, level)


def get_logger(name: str) -> Any:
    """A structlog logger bound to `name`. Configures the defaults if nothing has yet, so that
    early lines never land on stdout."""
    if _configured is None and not structlog.is_configured():
        configure_logging()
    return structlog.get_logger(name)
