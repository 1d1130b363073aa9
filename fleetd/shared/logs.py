"""One log format for both daemons: JSON lines off a terminal (journald), readable on one."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog


def configure_logging(level: str = "info", *, json: bool | None = None, stream: Any = None) -> None:
    """Configure structlog and route stdlib logging (botocore, aiomqtt, torch) through it.

    ``json=None`` picks JSON when ``stream`` is not a TTY. Call once at process start.
    """
    stream = stream or sys.stdout
    if json is None:
        json = not (hasattr(stream, "isatty") and stream.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty() if hasattr(stream, "isatty") else False)
    )
    lvl = logging.getLevelName(level.upper())
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Library loggers go through the same renderer so journald sees one format.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared[1:]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(lvl, logging.INFO) if lvl < logging.INFO else lvl)
    for noisy in ("botocore", "aiobotocore", "urllib3", "werkzeug"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def bind_context(**ctx: Any) -> None:
    """Bind process-wide context (fleet, instance_id, job) once; every later line carries it."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in ctx.items() if v is not None})


def get_logger(name: str | None = None) -> Any:
    return structlog.get_logger(name)
