"""The workers' output, batched and rate-capped on its way to the control host.

``LogBatcher.offer`` is called from the thread that reads torchrun's pipe, once per line; it never
blocks and never waits on the network: a line over the node's byte rate (a token bucket), or one
that finds the pending buffer full (the broker away for a while), is dropped and counted, and the
next batch says how many. Training must not slow down because its logs cannot leave the node; the
node's journal keeps every line. ``LogShipper`` takes a batch every ``interval_s`` or as soon as
``flush_bytes`` are waiting, whichever comes first, and publishes it (QoS 0, one ``WorkerLogs``
message per batch, split so that none exceeds the controller's payload limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from fleetd.protocol.messages import LogLine, WorkerLogs
from fleetd.shared.logs import get_logger
from fleetd.shared.waits import wait_set

log = get_logger(__name__)

INTERVAL_S = 1.0
# The brief's 64 KiB is measured in the lines' text; a message adds JSON quoting and the
# envelope, and the controller refuses payloads over 64 KiB (fleetd/intake/mqtt.py), so flush at
# half that and split what still encodes too large.
FLUSH_BYTES = 32 * 1024
MAX_MESSAGE_BYTES = 60 * 1024
# Per node. A trainer printing a line per step per rank stays far below; a runaway loop printing
# as fast as it can would otherwise send megabytes a second through the controller's one inbox.
RATE_BYTES_PER_S = 16 * 1024
BURST_S = 4.0  # the bucket holds this many seconds of the rate: a traceback goes out whole
# What waits while the broker is away (or the shipper is behind) before lines are dropped.
MAX_PENDING_BYTES = 256 * 1024
LINE_OVERHEAD = 16  # what a line costs beyond its text (JSON keys, rank): counted against the rate


@dataclass
class LogBatcher:
    job: str
    instance_id: str
    rate_bytes_per_s: float = RATE_BYTES_PER_S
    burst_s: float = BURST_S
    flush_bytes: int = FLUSH_BYTES
    max_pending_bytes: int = MAX_PENDING_BYTES
    clock: Callable[[], float] = time.monotonic
    # One agent run: sequence numbers start again at 0 in the next one, under a new stream name.
    stream: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    on_full: Callable[[], None] | None = None  # called (from the offering thread) at flush_bytes
    seq: int = 0  # the next batch's
    next_line: int = 0  # the stream offset of the next line offered (dropped ones count)
    dropped_total: int = 0
    _pending: list[LogLine] = field(default_factory=list)
    _pending_first: int = 0
    _pending_bytes: int = 0
    _dropped: int = 0  # since the last batch taken
    _tokens: float = -1.0
    _refilled_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _refill(self, now: float) -> None:
        cap = self.rate_bytes_per_s * self.burst_s
        if self._tokens < 0:
            self._tokens = cap
        else:
            self._tokens = min(cap, self._tokens + (now - self._refilled_at) * self.rate_bytes_per_s)
        self._refilled_at = now

    def offer(self, text: str, rank: int | None = None) -> bool:
        """Queue one line for the next batch; False when it was dropped (rate or buffer full)."""
        cost = len(text.encode(errors="replace")) + LINE_OVERHEAD
        full = False
        with self._lock:
            offset = self.next_line
            self.next_line += 1
            self._refill(self.clock())
            if cost > self._tokens or self._pending_bytes + cost > self.max_pending_bytes:
                self._dropped += 1
                self.dropped_total += 1
                return False
            self._tokens -= cost
            if not self._pending:
                self._pending_first = offset
            self._pending.append(LogLine(text=text, rank=rank))
            self._pending_bytes += cost
            full = self._pending_bytes >= self.flush_bytes
        if full and self.on_full is not None:
            self.on_full()
        return True

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def take(self) -> list[WorkerLogs]:
        """The batch of everything waiting (split to fit a message); [] when there is nothing,
        not even a drop to report."""
        with self._lock:
            lines, first, dropped = self._pending, self._pending_first, self._dropped
            if not lines and not dropped:
                return []
            if not lines:
                first = self.next_line
            self._pending, self._pending_bytes, self._dropped = [], 0, 0
        out: list[WorkerLogs] = []
        for chunk_first, chunk in _split(lines, first):
            out.append(self._message(chunk_first, chunk, dropped))
            dropped = 0  # said once, in the first batch after the drops
        return out

    def _message(self, first: int, lines: list[LogLine], dropped: int) -> WorkerLogs:
        msg = WorkerLogs(
            instance_id=self.instance_id,
            job=self.job,
            stream=self.stream,
            seq=self.seq,
            first_line=first,
            dropped=dropped,
            lines=tuple(lines),
        )
        self.seq += 1
        return msg


def _split(lines: list[LogLine], first: int) -> list[tuple[int, list[LogLine]]]:
    """Chunks whose encoded lines stay under MAX_MESSAGE_BYTES (the envelope is small)."""
    if not lines:
        return [(first, [])]
    chunks: list[tuple[int, list[LogLine]]] = []
    cur: list[LogLine] = []
    size, start = 0, first
    for i, line in enumerate(lines):
        n = len(line.model_dump_json()) + 1
        if cur and (size + n > MAX_MESSAGE_BYTES - 1024 or len(cur) >= 4096):
            chunks.append((start, cur))
            cur, size, start = [], 0, first + i
        cur.append(line)
        size += n
    chunks.append((start, cur))
    return chunks


@dataclass
class LogShipper:
    """Publishes the batcher's batches: every ``interval_s``, or at once when it is full. While
    the broker is away nothing is taken: lines wait in the batcher (bounded) for the reconnect."""

    batcher: LogBatcher
    publish: Callable[[WorkerLogs], Awaitable[None]]
    connected: Callable[[], bool]
    interval_s: float = INTERVAL_S
    sent: int = 0  # messages published
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()

        def wake() -> None:  # from the pipe reader's thread
            with contextlib.suppress(RuntimeError):  # the loop is closing: the agent is stopping
                loop.call_soon_threadsafe(self._wake.set)

        self.batcher.on_full = wake
        try:
            while True:
                await wait_set(self._wake, self.interval_s)
                self._wake.clear()
                await self.flush()
        finally:
            self.batcher.on_full = None

    async def flush(self) -> None:
        """Publish what waits now (nothing while disconnected: it keeps, bounded, till the reconnect)."""
        if not self.connected():
            return
        for msg in self.batcher.take():
            await self.publish(msg)
            self.sent += 1
