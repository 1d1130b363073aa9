"""Persisted ledger events in ``<state_dir>/fleetd.db`` (table ``ledger_events``).

The events are the truth; totals are always recomputed from them by the pure functions in
fleetd.policy.ledger, so a restarted fleetd reports exactly the same spend. An event with an
``event_id`` is stored once (a retry after a crash cannot double-charge); rows this build cannot
read are logged and skipped, never fatal, and never deleted.

sqlite3 blocks, so the async methods run it in a worker thread (one connection, one lock). The
events are also kept in memory (read once at open, appended on write), so the reconcile loop's
per-pass spend never re-reads the table; one process (the daemon) writes, others only read.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from fleetd.policy import ledger
from fleetd.policy.ledger import EVENT_KINDS, EVENT_TYPES, LedgerEvent, LedgerSummary
from fleetd.policy.ledger_compact import compact
from fleetd.policy.model import Market, PoolId
from fleetd.reconcile import schema
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

DB_NAME = "fleetd.db"
SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    event_id TEXT UNIQUE,             -- NULL: no de-duplication key
    payload TEXT NOT NULL             -- JSON of the event's fields
);
CREATE INDEX IF NOT EXISTS ledger_events_at ON ledger_events(at);
"""


class LedgerStoreError(Exception):
    """The ledger database cannot be opened or written (path, permissions, corruption)."""


def encode(event: LedgerEvent) -> tuple[str, str]:
    kind = EVENT_KINDS.get(type(event))
    if kind is None:
        raise TypeError(f"not a ledger event: {event!r}")
    data = asdict(event)
    # asdict turns a nested PoolId into a dict: store it as "type@zone" text, markets by value.
    for f in fields(event):
        if f.name == "pool":
            data["pool"] = str(getattr(event, f.name))
        elif f.name == "market":
            data["market"] = getattr(event, f.name).value
    return kind, json.dumps(data, sort_keys=True)


def decode(kind: str, payload: str) -> LedgerEvent:
    """Raises ValueError for a row this build does not understand."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown ledger event kind {kind!r}")
    data: dict[str, Any] = json.loads(payload)
    if not isinstance(data, dict):
        raise ValueError("payload is not a JSON object")
    if "pool" in data:
        data["pool"] = PoolId.parse(data["pool"])
    if "market" in data:
        data["market"] = Market(data["market"])
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(str(exc)) from None


class LedgerStore:
    """Append-only event log. Use ``await LedgerStore.open(path)``; ``await store.close()``."""

    def __init__(self, conn: sqlite3.Connection, path: Path):
        self._conn = conn
        self._path = path
        self._lock = threading.Lock()
        self._cache: list[LedgerEvent] | None = None
        self._billing_version = 0  # bumped by every stored billing event (spent_usd's cache key)
        self._basis: tuple[int, ledger.SpendBasis] | None = None

    @property
    def path(self) -> Path:
        return self._path

    @classmethod
    def open_sync(cls, path: Path) -> LedgerStore:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            try:
                schema.refuse_newer(conn, path)  # a newer build's file: touch nothing (same file as the state)
            except schema.SchemaTooNew:
                conn.close()
                raise
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(SCHEMA)
        except (sqlite3.Error, OSError) as exc:
            raise LedgerStoreError(f"cannot open ledger {path}: {exc}") from exc
        return cls(conn, path)

    @classmethod
    async def open(cls, path: Path) -> LedgerStore:
        return await asyncio.to_thread(cls.open_sync, path)

    # ------------------------------------------------------------------ sync core (worker thread)
    def append_sync(self, events: list[LedgerEvent]) -> int:
        rows = []
        for e in events:
            kind, payload = encode(e)
            rows.append((e.at, kind, e.event_id or None, payload))
        with self._lock:
            stored: list[LedgerEvent] = []
            try:
                with self._conn:  # one transaction: all of them or none
                    self._conn.execute("BEGIN")
                    for event, row in zip(events, rows, strict=True):
                        cur = self._conn.execute(
                            "INSERT OR IGNORE INTO ledger_events(at, kind, event_id, payload) VALUES (?, ?, ?, ?)",
                            row,
                        )
                        if cur.rowcount == 1:  # 0: this event_id is already stored
                            stored.append(event)
            except sqlite3.Error as exc:
                raise LedgerStoreError(f"cannot write ledger {self._path}: {exc}") from exc
            if self._cache is not None:
                self._cache.extend(stored)
            if any(isinstance(e, ledger.BILLING_EVENTS) for e in stored):
                self._billing_version += 1
            return len(stored)

    def events_sync(self) -> list[LedgerEvent]:
        with self._lock:
            if self._cache is None:
                self._cache = self._read_all()
            return list(self._cache)

    def _read_all(self) -> list[LedgerEvent]:
        try:
            rows = self._conn.execute("SELECT seq, kind, payload FROM ledger_events ORDER BY seq").fetchall()
        except sqlite3.Error as exc:
            raise LedgerStoreError(f"cannot read ledger {self._path}: {exc}") from exc
        out: list[LedgerEvent] = []
        for seq, kind, payload in rows:
            try:
                out.append(decode(kind, payload))
            except (ValueError, json.JSONDecodeError) as exc:
                log.warning("ledger_row_skipped", seq=seq, kind=kind, error=str(exc), db=str(self._path))
        return out

    def compact_sync(self, before: float) -> tuple[int, int]:
        """Roll the per-pass rows older than ``before`` up (fleetd.policy.ledger_compact), in one
        transaction, memory included: (rows dropped, rows added). The freed pages are reused by
        later rows, so the file stops growing with passes."""
        with self._lock:
            if self._cache is None:
                self._cache = self._read_all()
            plan = compact(self._cache, before)
            if plan.empty:
                return 0, 0
            rows = []
            for e in plan.add:
                kind, payload = encode(e)
                rows.append((e.at, kind, e.event_id or None, payload))
            try:
                with self._conn:
                    self._conn.execute("BEGIN")
                    self._conn.executemany(
                        "DELETE FROM ledger_events WHERE event_id=?", [(e.event_id,) for e in plan.drop]
                    )
                    self._conn.executemany(
                        "INSERT OR IGNORE INTO ledger_events(at, kind, event_id, payload) VALUES (?, ?, ?, ?)", rows
                    )
            except sqlite3.Error as exc:
                raise LedgerStoreError(f"cannot compact ledger {self._path}: {exc}") from exc
            dropped = {id(e) for e in plan.drop}
            self._cache = [e for e in self._cache if id(e) not in dropped] + list(plan.add)
            if any(isinstance(e, ledger.BILLING_EVENTS) for e in (*plan.drop, *plan.add)):
                self._billing_version += 1  # never today (compaction keeps billing), but exact if so
            return len(plan.drop), len(plan.add)

    def close_sync(self) -> None:
        with self._lock:
            self._conn.close()

    # ----------------------------------------------------------------------------- async surface
    async def append(self, *events: LedgerEvent) -> int:
        """Store events (idempotent per event_id); returns how many were new."""
        return await asyncio.to_thread(self.append_sync, list(events))

    async def events(self) -> list[LedgerEvent]:
        return await asyncio.to_thread(self.events_sync)

    async def summary(self, now: float, observed_until: dict[str, float] | None = None) -> LedgerSummary:
        return ledger.summarize(await self.events(), now, observed_until)

    async def spent_usd(self, now: float) -> float:
        """fleetd.reconcile.ports.SpendSource: everything accrued so far. Every pass asks; the
        ended instances' part is kept until a billing event arrives (ledger.SpendBasis)."""
        return (await asyncio.to_thread(self._basis_sync)).at(now)

    def _basis_sync(self) -> ledger.SpendBasis:
        with self._lock:
            if self._basis is None or self._basis[0] != self._billing_version:
                if self._cache is None:
                    self._cache = self._read_all()
                self._basis = (self._billing_version, ledger.spend_basis(self._cache))
            return self._basis[1]

    async def compact(self, before: float) -> tuple[int, int]:
        return await asyncio.to_thread(self.compact_sync, before)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)
