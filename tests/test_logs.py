"""Logging: JSON lines off a terminal with bound context; readable text on a terminal."""

from __future__ import annotations

import io
import json
import logging
import re

import structlog

from fleetd.shared.logs import bind_context, configure_logging, get_logger


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_with_bound_context() -> None:
    out = io.StringIO()
    configure_logging("info", stream=out)
    bind_context(fleet="llm-a", instance_id="i-1", job=None)
    try:
        get_logger("t").info("launched", pool="g5.xlarge@us-east-1a", count=2)
        get_logger("t").debug("hidden")
        logging.getLogger("some.library").warning("from stdlib")
    finally:
        structlog.contextvars.clear_contextvars()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "launched" and lines[0]["fleet"] == "llm-a"
    assert lines[0]["instance_id"] == "i-1" and "job" not in lines[0]
    assert lines[0]["level"] == "info" and lines[0]["timestamp"].endswith("Z")
    assert len(lines) == 2 and lines[1]["event"] == "from stdlib" and lines[1]["level"] == "warning"


def test_console_on_a_terminal() -> None:
    out = _Tty()
    configure_logging("info", stream=out)
    get_logger("t").info("hello", x=1)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert "hello" in text and "x=1" in text
    assert not text.lstrip().startswith("{")
