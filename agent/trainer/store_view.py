"""Rank 0's per-step look at the rendezvous store, kept through a store outage.

Every step, rank 0 reads the newest checkpoint request and bumps the progress counter
(agent.trainer.elastic). When the store dies or restarts, those reads fail; the workers used to
fail with them (saving the step first) and torchrun restarted every node. Training does not need
the store (gloo has its own), so rank 0 now keeps training, retries the store between steps (a
short connect, at most once per ``RETRY_EVERY_S``) and tells the other ranks, through the value
all ranks agree on each step, which life of the store the request numbers belong to.

The agreed value packs (generation, request number): ``generation * GEN + seq``. A restarted
store starts its request numbers again from 0, so every rank resets its handled number when the
generation moves, in the same step (the value comes from one all-reduce).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

GEN = 1 << 32
RETRY_EVERY_S = 1.0
CONNECT_TIMEOUT_S = 0.3


def pack(generation: int, seq: int) -> int:
    return generation * GEN + seq


def unpack(value: int) -> tuple[int, int]:
    return divmod(value, GEN)


class StoreView:
    """Rank 0 only. ``seen(handled)`` never raises for a store outage."""

    def __init__(self, link: Any, emit: Callable[..., None], clock: Callable[[], float] = time.monotonic) -> None:
        from agent.trainer.store_link import StoreLinkError

        self._errors = (StoreLinkError,)
        self.link = link
        self.emit = emit
        self.clock = clock
        self.generation = 0
        self.down_at: float | None = None
        self.tried_at = 0.0
        try:
            self.incarnation = link.incarnation()
        except StoreLinkError:
            self.incarnation = None

    def seen(self, handled_seq: int, pulse: Callable[[], None]) -> int:
        """The packed (generation, newest request) rank 0 sees now; while the store is down, the
        request already handled (nothing new to answer)."""
        if self.down_at is not None and not self._retry():
            return pack(self.generation, handled_seq)
        try:
            pulse()
            return pack(self.generation, self.link.latest_request_seq())
        except self._errors as exc:
            now = self.clock()
            self.down_at = self.tried_at = now
            self.link.drop()
            self.emit("store_lost", error=str(exc)[:200], why="training on; retrying the store between steps")
            return pack(self.generation, handled_seq)

    def _retry(self) -> bool:
        now = self.clock()
        if now - self.tried_at < RETRY_EVERY_S:
            return False
        self.tried_at = now
        try:
            self.link.reconnect(CONNECT_TIMEOUT_S)
            incarnation = self.link.incarnation()
        except self._errors:
            self.link.drop()
            return False
        new = incarnation != self.incarnation
        if new:
            self.generation += 1
            self.incarnation = incarnation
        self.emit("store_back", down_s=round(now - (self.down_at or now), 2), new_store=new)
        self.down_at = None
        return True
