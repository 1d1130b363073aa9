"""A bounded pool of upload slots handed out by priority instead of arrival order.

Every part upload of every checkpoint takes a slot, so the total number of bytes in flight (and in
memory) is bounded by ``capacity × part size`` however many checkpoints are being uploaded. When a
slot frees up it goes to the most urgent waiter: a checkpoint with a notice deadline before one
without, then the newest step first. That is what makes the uploader deadline-aware: after a
notice, the newest checkpoint's parts overtake the parts of older checkpoints still queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator


def priority(step: int, urgent: bool) -> tuple[int, int]:
    """Smaller sorts first: urgent (deadline) uploads, then newer steps."""
    return (0 if urgent else 1, -step)


class PrioritySlots:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self._free = capacity
        self._waiters: list[tuple[tuple[int, int], int, asyncio.Future[None]]] = []
        self._order = itertools.count()  # FIFO among equal priorities

    @contextlib.asynccontextmanager
    async def slot(self, prio: tuple[int, int]) -> AsyncIterator[None]:
        await self._acquire(prio)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, prio: tuple[int, int]) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (prio, next(self._order), fut))
        try:
            await fut
        except asyncio.CancelledError:
            # Granted just as we were cancelled: pass the slot on rather than leak it.
            if fut.done() and not fut.cancelled():
                self._release()
            raise

    def _release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self._free += 1
