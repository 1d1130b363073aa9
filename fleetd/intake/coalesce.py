"""The intake's inbox: events in arrival order, telemetry coalesced to the latest sample per node.

At 2,000 agents telemetry is 2,000 messages a second. When the controller falls behind (a pass
planning the fleet, a loaded host), a FIFO of every sample grows, or the broker drops what its
queue for us cannot hold, and a notice waits behind seconds of stale utilisation reports. A
telemetry sample only says "this node's rates as of now": the next one from the same node
replaces it without losing a fact. So the inbox keeps at most one pending sample per key (the
topic: one node's telemetry channel); a newer one takes the older one's place in the line
(the node keeps its turn) and the older one is counted as *superseded*, which is not a lost
message. Everything else (status, notices, checkpoint receipts, trainer exits) is never
coalesced nor dropped, and leaves in the order it came, ahead of every waiting sample: a notice
that arrives behind 2,000 samples is the next thing handled, not the 2,001st (samples are rates
as of now; handled a few milliseconds later they say the same).

Memory: the events in the line, plus at most one telemetry sample per distinct key.

An ``asyncio.Queue`` subclass (the ``_init/_put/_get`` hooks PriorityQueue uses), so the MQTT
client library puts into it from its socket callback as into its default queue.
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
        self.superseded += 1
        if self._on_superseded is not None:
            self._on_superseded(old)

    def _get(self) -> T:
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
