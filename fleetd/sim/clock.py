"""The simulator's virtual clock: a heap of timed callbacks, no asyncio, no sleeping."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

# Same-time ordering: trace changes first, then notices, then policy work.
TRACE, NOTICE, POLICY = 0, 1, 2


class Timer:
    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class EventQueue:
    """A heap of (time, priority, seq) -> callback, and the virtual clock it drives."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Timer, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None], priority: int = POLICY) -> Timer:
        timer = Timer()
        heapq.heappush(self._heap, (max(t, self.now), priority, next(self._seq), timer, fn))
        return timer

    def pop_until(self, horizon: float) -> Callable[[], None] | None:
        while self._heap and self._heap[0][0] <= horizon:
            t, _, _, timer, fn = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            self.now = t
            return fn
        return None
