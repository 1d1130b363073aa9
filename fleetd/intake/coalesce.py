"""The intake's inbox: events in arrival order, telemetry coalesced to the latest sample per node.

At 2,000 agents a FIFO of every sample grows whenever the controller falls behind, and a notice
waits behind seconds of stale samples. Here a newer sample replaces its node's waiting one, and
events leave in order ahead of every sample; memory is the events plus one sample per key. An
``asyncio.Queue`` subclass (PriorityQueue's hooks), so the MQTT client library puts into it as into
its default queue. (docs/DESIGN.md "Wire protocol (MQTT)")
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class CoalescingQueue(asyncio.Queue, Generic[T]):  # type: ignore[type-arg]
    """``key(item)``: None for an event (kept, in order), else the key under which only the
    latest item waits. ``on_superseded(old)`` is called for each item replaced by a newer one."""

    def __init__(
        self, maxsize: int = 0, *, key: Callable[[T], Hashable | None], on_superseded: Callable[[T], None] | None = None
    ) -> None:
        self._key = key
        self._on_superseded = on_superseded
        self.superseded = 0
        super().__init__(maxsize)

    # asyncio.Queue sizes itself by len(self._queue): the two lines together.
    def _init(self, maxsize: int) -> None:
        self._queue = _Lines()
        self._latest: dict[Hashable, T] = {}

    def _put(self, item: T) -> None:
        k = self._key(item)
        if k is None:
            self._queue.events.append(item)
            return
        old = self._latest.get(k)
        self._latest[k] = item
        if old is None:
            self._queue.keys.append(k)
            return
        # Not a lost message: a sample says "this node's rates as of now", and the newer one says it
        # without losing a fact. The node keeps its place in the line.
        self.superseded += 1
        if self._on_superseded is not None:
            self._on_superseded(old)

    def _get(self) -> T:
        # Events first: a notice behind 2,000 samples is the next thing handled (samples handled a
        # few milliseconds later say the same).
        if self._queue.events:
            event: T = self._queue.events.popleft()
            return event
        return self._latest.pop(self._queue.keys.popleft())

    def pending_keys(self) -> int:
        """How many coalesced samples wait (at most one per key)."""
        return len(self._latest)


class _Lines:
    """Events in arrival order, then the keys of the waiting samples in arrival order (a key's
    current sample is in ``CoalescingQueue._latest``)."""

    __slots__ = ("events", "keys")

    def __init__(self) -> None:
        self.events: deque[Any] = deque()
        self.keys: deque[Hashable] = deque()

    def __len__(self) -> int:
        return len(self.events) + len(self.keys)
