"""When EC2 says an instance changed state: billing ends where it left running, not where fleetd
happened to notice (fleetd/reconcile/state.py closes the record there)."""

from __future__ import annotations

import re
from datetime import UTC, datetime

_TRANSITION_AT = re.compile(r"\((\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}) (?:GMT|UTC)\)")


def transition_time(reason: str) -> float | None:
    """The time in a StateTransitionReason such as "User initiated (2026-11-24 05:00:00 GMT)"
    (moto writes UTC); None when it carries none."""
    m = _TRANSITION_AT.search(reason)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC).timestamp()
