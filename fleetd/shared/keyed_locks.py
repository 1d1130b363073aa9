"""One asyncio lock per key, kept only while someone holds or waits for it.

For work that must not run twice at once for the same thing (a node's drain: record, send, mark)
but may run side by side for different things. A lock per key kept forever would grow with every
node the fleet ever had; this one is dropped once its last user is done.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class KeyedLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[asyncio.Lock, int]] = {}

    def busy(self, key: Hashable) -> bool:
        """Someone holds or waits for ``key``'s lock."""
        return key in self._locks

    @contextlib.asynccontextmanager
    async def hold(self, key: Hashable) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
