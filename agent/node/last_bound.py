"""The agent process's last shutdown bound: a process that never exits keeps a node billing."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

from fleetd.shared.logs import get_logger

log = get_logger(__name__)

# Cancelled tasks end in milliseconds; one still running this long after the bounded shutdown
# swallowed its cancellation or waits on something that cannot be cancelled.
CANCEL_GRACE_S = 5.0


def exit_unless_done(grace_s: float, tasks: list[asyncio.Task[Any]]) -> threading.Timer:
    """The last bound of the shutdown: a process that never exits keeps a node billing (its
    power-off never comes) and, in the demo, outlives it. Past ``grace_s`` after the tasks were
    cancelled, log what each one still awaits and exit the process."""

    def stuck() -> None:
        pending = [t for t in tasks if not t.done()]
        stacks = {
            t.get_name(): [f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}" for f in t.get_stack()]
            for t in pending
        }
        log.error("agent_shutdown_stuck", grace_s=grace_s, tasks=stacks)
        os._exit(1)

    timer = threading.Timer(grace_s, stuck)
    timer.daemon = True
    timer.start()
    return timer
