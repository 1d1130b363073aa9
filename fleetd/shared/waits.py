"""Waiting with a time limit without losing a cancellation (shared by the controller and the agent).

Python 3.11's ``asyncio.wait_for`` returns the awaited result instead of raising when its task is
cancelled in the same loop iteration as the awaited thing completes (CPython gh-86296; 3.12
rebuilt ``wait_for`` on ``asyncio.timeout``). A loop that waits on an event others set often (the
reconcile loop's wake-up, set by every finished cloud call) then goes on after a stop: the daemon's
bounded shutdown hangs. ``asyncio.timeout`` tells its own expiry from a cancellation by counting
them, so both helpers here are built on it, and fleetd and the agent use them instead of
``wait_for``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_set(event: asyncio.Event, timeout_s: float) -> bool:
    """True once ``event`` is set, False after ``timeout_s``; a cancellation always propagates."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(max(0.0, timeout_s)):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def within(awaitable: Awaitable[T], timeout_s: float) -> T:
    """``await awaitable``, or TimeoutError after ``timeout_s`` (a coroutine is cancelled then)."""
    async with asyncio.timeout(max(0.0, timeout_s)):
        return await awaitable
