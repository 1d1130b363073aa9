"""The agent's outgoing QoS 1 events: held until the broker acknowledges them.

Events (notice, checkpoint-saved, ...) must survive broker restarts, network drops and an agent
restart. Each event stays here until its PUBACK arrives; a journal file in ``state_dir`` records
puts and acks so a restarted agent re-sends what was never acknowledged. Re-sending may duplicate
an event the broker did receive; the controller de-duplicates by ``msg_id``.

The journal is append-only (one JSON line per put or ack) and is truncated whenever the outbox
runs empty, so it stays small. It is not fsynced: an agent restart loses nothing, a kernel crash
may lose the last lines, which is the cheap trade-off the design asks for.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleetd.shared.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class OutboxItem:
    msg_id: str
    topic: str
    payload: bytes


class Outbox:
    """FIFO of unacknowledged events, bounded (oldest dropped, loudly), optionally journaled."""

    def __init__(self, journal: Path | None = None, *, max_items: int = 10_000) -> None:
        self.journal = journal
        self.max_items = max_items
        self._items: OrderedDict[str, OutboxItem] = OrderedDict()
        self._nonempty = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._io_lock = asyncio.Lock()  # keeps journal lines in the order the calls were made
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    async def open(self) -> int:
        """Load unacknowledged events from the journal; returns how many were recovered."""
        if self.journal is None:
            return 0
        try:
            items = await asyncio.to_thread(_replay, self.journal)
        except OSError as exc:
            log.error("outbox_journal_unreadable", journal=str(self.journal), error=str(exc))
            items = []
        for item in items:
            self._items[item.msg_id] = item
        self._trim()
        self._update_events()
        if items:
            log.info("outbox_recovered", events=len(items), journal=str(self.journal))
        # Rewrite the journal compactly so old acked lines do not pile up across restarts.
        await self._write(_rewrite, self.journal, list(self._items.values()))
        return len(items)

    async def put(self, item: OutboxItem) -> None:
        if item.msg_id in self._items:
            return
        self._items[item.msg_id] = item
        self._trim()
        self._update_events()
        if self.journal is not None:
            line = json.dumps({"op": "put", "id": item.msg_id, "topic": item.topic, "payload": item.payload.decode()})
            await self._write(_append, self.journal, line)

    async def ack(self, msg_id: str) -> None:
        if self._items.pop(msg_id, None) is None:
            return
        self._update_events()
        if self.journal is not None:
            if not self._items:
                await self._write(_rewrite, self.journal, [])
            else:
                await self._write(_append, self.journal, json.dumps({"op": "ack", "id": msg_id}))

    async def _write(self, fn: Callable[..., None], *args: object) -> None:
        """Journal I/O off the event loop, in call order. A full or read-only disk costs only the
        restart guarantee: the event is still held in memory and delivered, never lost here."""
        async with self._io_lock:
            try:
                await asyncio.to_thread(fn, *args)
            except OSError as exc:
                log.error("outbox_journal_failed", journal=str(self.journal), error=str(exc))

    async def first(self) -> OutboxItem:
        """The oldest unacknowledged event (not removed); waits while the outbox is empty."""
        while not self._items:
            await self._nonempty.wait()
        return next(iter(self._items.values()))

    async def wait_empty(self) -> None:
        await self._empty.wait()

    def _trim(self) -> None:
        while len(self._items) > self.max_items:
            msg_id, item = self._items.popitem(last=False)
            self.dropped += 1
            log.error("outbox_overflow_dropped", msg_id=msg_id, topic=item.topic, max_items=self.max_items)

    def _update_events(self) -> None:
        if self._items:
            self._nonempty.set()
            self._empty.clear()
        else:
            self._nonempty.clear()
            self._empty.set()


def _append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(line + "\n")


def _rewrite(path: Path, items: list[OutboxItem]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for item in items:
            f.write(
                json.dumps({"op": "put", "id": item.msg_id, "topic": item.topic, "payload": item.payload.decode()})
                + "\n"
            )
    tmp.replace(path)


def _replay(path: Path) -> list[OutboxItem]:
    if not path.exists():
        return []
    pending: OrderedDict[str, OutboxItem] = OrderedDict()
    bad = 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            if rec["op"] == "put":
                pending[rec["id"]] = OutboxItem(rec["id"], rec["topic"], rec["payload"].encode())
            elif rec["op"] == "ack":
                pending.pop(rec["id"], None)
        except (ValueError, KeyError, TypeError, AttributeError):
            bad += 1  # a line torn by a crash mid-write: skip it, keep the rest
    if bad:
        log.warning("outbox_journal_bad_lines", lines=bad, journal=str(path))
    return list(pending.values())
