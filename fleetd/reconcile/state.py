"""The reconcile loop's memory in ``<state_dir>/fleetd.db``: launches, instances, pool statistics.

Launches are written as an intent before CreateFleet and settled by their ``fleetd:launch`` tag
after a crash (never a second purchase); instances keep their price, bid and whether fleetd
terminated them (not an interruption); pool statistics feed placement's interruption rates;
``meta`` keeps small loop memory (docs/DESIGN.md "Controller restart"). sqlite3 is blocking, so
every call runs in a worker thread (one connection, one lock).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile import schema, state_sql

# Re-exported (explicitly, `X as X`): callers use st.<Row>.
from fleetd.reconcile.state_rows import ABANDONED as ABANDONED
from fleetd.reconcile.state_rows import FAILED as FAILED
from fleetd.reconcile.state_rows import LAUNCHED as LAUNCHED
from fleetd.reconcile.state_rows import OPEN as OPEN
from fleetd.reconcile.state_rows import TERMINAL as TERMINAL
from fleetd.reconcile.state_rows import DrainRecord as DrainRecord
from fleetd.reconcile.state_rows import InstanceRow as InstanceRow
from fleetd.reconcile.state_rows import LaunchRow as LaunchRow
from fleetd.reconcile.state_rows import PoolStatsRow as PoolStatsRow
from fleetd.reconcile.state_rows import SeenInstance as SeenInstance
from fleetd.reconcile.state_rows import SyncReport as SyncReport
from fleetd.reconcile.state_sql import (
    SCHEMA,
    ensure_pool,
    observed_until,
    sync_instances_tx,
)

_T = TypeVar("_T")

_OPEN = " WHERE ended_at IS NULL"
_MARKETS = {m.value: m for m in Market}  # a dict lookup: Market(value) per row was a fifth of the read


class StateStore:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._private_dir: Path | None = None  # open_snapshot's copy, deleted on close
        # Only the daemon writes the file (the CLI reads it), so what it last read stays true until
        # it writes: whole-table instance reads (pass, ledger feed, status snapshot: 3 x 2,000 rows
        # a pass) are kept until a call changes a row (``_version``), the meta table until
        # ``set_meta``. A hit costs no worker-thread hop: at 2,000 agents each hop of a pass waited
        # a turn of an event loop busy with telemetry.
        self._version = 0  # calls that changed a row so far
        self._rows_cache: dict[str, tuple[int, tuple[InstanceRow, ...]]] = {}
        self._meta: dict[str, str] | None = None  # key -> JSON, once read

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def open(cls, state_dir: Path) -> StateStore:
        store = cls(Path(state_dir) / "fleetd.db")
        await asyncio.to_thread(store._open)
        return store

    @classmethod
    async def open_snapshot(cls, state_dir: Path) -> StateStore:
        """A private copy of the state (for --dry-run): plans see the real history, and nothing
        the dry run records touches the live database."""
        import tempfile

        src = Path(state_dir) / "fleetd.db"
        store = cls(Path(tempfile.mkdtemp(prefix="fleetd-dry-run-")) / "fleetd.db")
        store._private_dir = store.path.parent  # removed by close: every dry run made one more

        def copy() -> None:
            if src.exists():
                with sqlite3.connect(f"file:{src}?mode=ro", uri=True) as live, sqlite3.connect(store.path) as snap:
                    live.backup(snap)
            store._open()

        await asyncio.to_thread(copy)
        return store

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            schema.refuse_newer(db, self.path)  # before anything (even WAL mode) writes to a newer build's file
        except schema.SchemaTooNew:
            db.close()
            raise
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")  # an intent must be on disk before CreateFleet
        db.executescript(SCHEMA)
        schema.migrate(db, self.path)
        self._db = db

    async def close(self) -> None:
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        # Under the lock: a call whose awaiting task was cancelled (a bounded shutdown) still runs
        # in its worker thread, and closing the connection under it is a use-after-free in
        # sqlite3 (a stress test segfaulted the interpreter; the likely cause of a CI run that
        # died that way). Waiting for it is short: every call is one small transaction.
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            if self._private_dir is not None:
                shutil.rmtree(self._private_dir, ignore_errors=True)
                self._private_dir = None

    async def _run(
        self,
        fn: Callable[..., _T],
        *args: Any,
        then: Callable[[sqlite3.Connection, _T], object] | None = None,
        unseen: Callable[[_T], bool] | None = None,
    ) -> _T:
        """``fn(db, *args)`` in one transaction in a worker thread; ``then(db, result)`` after it
        under the same lock, with ``_version`` already counting fn's changes (a read to cache).
        ``unseen(result)``: True when fn changed only columns no cached read shows."""

        def call() -> _T:
            with self._lock:
                assert self._db is not None, "StateStore is closed"
                before = self._db.total_changes
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(self._db, *args)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    self._version += 1  # whatever it changed is undone: the safe side
                    raise
                if self._db.total_changes != before and not (unseen is not None and unseen(result)):
                    self._version += 1
                self._db.execute("COMMIT")
                if then is not None:
                    then(self._db, result)
                return result

        return await asyncio.to_thread(call)

    # -- launches -------------------------------------------------------------------------------
    async def settled_launch_count(self) -> int:
        return await self._run(
            lambda db: db.execute("SELECT COUNT(*) FROM launches WHERE status != ?", (OPEN,)).fetchone()[0]
        )

    async def record_intent(
        self,
        *,
        token: str,
        seq: int,
        now: float,
        count: int,
        market: Market,
        pools: Sequence[PoolId],
        purpose: str,
        max_price_per_hour: float | None,
        reason: str,
    ) -> None:
        """Write the launch before buying it. Other open intents are abandoned: the loop is
        level-based, so only the launch planned now is worth resuming."""
        pools_json = json.dumps([str(p) for p in pools])
        row = (token, seq, now, count, str(market), pools_json, purpose, max_price_per_hour, reason, OPEN)
        await self._run(state_sql.record_intent_tx, token, now, row)

    async def settle_launch(
        self, token: str, status: str, instance_ids: Iterable[str], now: float, detail: str = ""
    ) -> None:
        await self._run(
            lambda db: db.execute(
                "UPDATE launches SET status=?, instance_ids=?, settled_at=?, detail=? WHERE token=?",
                (status, json.dumps(sorted(instance_ids)), now, detail, token),
            )
        )

    async def launches(self, status: str | None = None) -> list[LaunchRow]:
        return await self._select_launches(" WHERE status=?" if status else "", (status,) if status else ())

    async def _select_launches(self, where: str, args: tuple[Any, ...]) -> list[LaunchRow]:
        return await self._run(state_sql.select_launches, where, args)

    async def unresolved_launches(self, since: float) -> list[LaunchRow]:
        """Open intents, and launches abandoned since ``since`` without instances: their
        instances may still show up (EC2's eventual consistency) and must be attributed."""
        return await self._select_launches(
            " WHERE status=? OR (status=? AND instance_ids='[]' AND settled_at >= ?)", (OPEN, ABANDONED, since)
        )

    async def launches_since(self, purpose: str, since: float) -> int:
        return await self._run(
            lambda db: db.execute(
                "SELECT COUNT(*) FROM launches WHERE purpose=? AND status=? AND settled_at >= ?",
                (purpose, LAUNCHED, since),
            ).fetchone()[0]
        )

    # -- instances ------------------------------------------------------------------------------
    async def record_launched(self, seen: Sequence[SeenInstance], max_price_per_hour: float | None, now: float) -> None:
        """Instances a launch returned (before DescribeInstances shows them)."""
        await self._run(state_sql.record_launched_tx, seen, max_price_per_hour, now)

    async def sync_instances(self, seen: Sequence[SeenInstance], now: float) -> SyncReport:
        """Fold one DescribeInstances answer into the table: adopt unknown instances, accrue
        node-hours per pool, and close instances that ended (counting losses). The open rows
        are read again in the same hop (the pass reads them next)."""
        report, _ = await self._run(
            sync_instances_tx,
            seen,
            now,
            unseen=lambda r: not r[1],
            then=lambda db, r: self._read_instances(db, _OPEN, ()) if r[1] else None,
        )
        return report

    _INSTANCE_COLUMNS = (
        "instance_id, pool, market, price_per_hour, max_price_per_hour, launched_at, launch_token, ec2_state,"
        " first_seen_at, notice_at, drain_started_at, terminate_requested_at, ended_at, end_reason"
    )

    async def instances(self, open_only: bool = True) -> list[InstanceRow]:
        return await self._select_instances(_OPEN if open_only else "", ())

    async def instances_by_id(self, instance_ids: Sequence[str]) -> list[InstanceRow]:
        marks = ",".join("?" * len(instance_ids))
        return await self._select_instances(f" WHERE instance_id IN ({marks})", tuple(instance_ids))

    async def _select_instances(self, where: str, args: tuple[Any, ...]) -> list[InstanceRow]:
        cached = self._rows_cache.get(where) if not args else None
        if cached is not None and cached[0] == self._version:
            return list(cached[1])  # rows are frozen; the list is the caller's own
        return await self._run(self._read_instances, where, args)

    def _read_instances(self, db: sqlite3.Connection, where: str, args: tuple[Any, ...]) -> list[InstanceRow]:
        sql = f"SELECT {self._INSTANCE_COLUMNS} FROM instances{where} ORDER BY instance_id"
        pools: dict[str, PoolId] = {}
        rows = [
            InstanceRow(r[0], pools.get(r[1]) or pools.setdefault(r[1], PoolId.parse(r[1])), _MARKETS[r[2]], *r[3:])
            for r in db.execute(sql, args)
        ]
        if not args:  # under the store's lock: no write since the rows were read
            self._rows_cache[where] = (self._version, tuple(rows))
        return rows

    async def mark_terminate_requested(self, instance_ids: Sequence[str], now: float) -> None:
        await self._run(
            lambda db: db.executemany(
                "UPDATE instances SET terminate_requested_at=COALESCE(terminate_requested_at, ?) WHERE instance_id=?",
                [(now, i) for i in instance_ids],
            )
        )

    async def record_notice(self, instance_id: str, at: float) -> bool:
        """Count an interruption notice once per instance; True when it was new."""

        def tx(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT pool, notice_at FROM instances WHERE instance_id=?", (instance_id,)).fetchone()
            if row is None or row[1] is not None:
                return False
            db.execute("UPDATE instances SET notice_at=? WHERE instance_id=?", (at, instance_id))
            ensure_pool(db, row[0])
            db.execute(
                "UPDATE pool_stats SET notices=notices+1, last_notice_at=MAX(COALESCE(last_notice_at,0),?)"
                " WHERE pool=?",
                (at, row[0]),
            )
            return True

        return await self._run(tx)

    # -- the drain/termination journal (fleetd.reconcile.journal) ------------------------------
    async def record_drain(self, instance_id: str, now: float, deadline: float | None, reason: str) -> DrainRecord:
        return await self._run(state_sql.record_drain, instance_id, now, deadline, reason)

    async def mark_drain_sent(self, instance_id: str, now: float) -> None:
        await self._run(
            lambda db: db.execute(
                "UPDATE instances SET drain_sent_at=COALESCE(drain_sent_at, ?) WHERE instance_id=?", (now, instance_id)
            )
        )

    async def unsent_drains(self) -> list[DrainRecord]:
        return await self._run(state_sql.unsent_drains)

    async def unfinished_terminations(self, before: float) -> list[str]:
        return await self._run(state_sql.unfinished_terminations, before)

    # -- pools ----------------------------------------------------------------------------------
    async def mark_pool_unavailable(self, pool: PoolId, until: float, code: str, market: Market = Market.SPOT) -> None:
        """A capacity error blocks ``pool`` for ``market`` only: EC2's spot and on-demand capacity
        run out independently, so one market's shortage must not keep fleetd from the other."""
        column = "capacity_error_until" if market is Market.SPOT else "on_demand_capacity_error_until"

        def tx(db: sqlite3.Connection) -> None:
            ensure_pool(db, str(pool))
            db.execute(
                "UPDATE pool_stats SET capacity_errors=capacity_errors+1, last_error_code=?,"
                f" {column}=MAX(COALESCE({column}, 0), ?) WHERE pool=?",
                (code, until, str(pool)),
            )

        await self._run(tx)

    async def pool_stats(self) -> list[PoolStatsRow]:
        def q(db: sqlite3.Connection) -> list[PoolStatsRow]:
            rows = db.execute(
                "SELECT pool, node_seconds, notices, losses, capacity_errors, capacity_error_until,"
                " last_error_code, last_notice_at, on_demand_capacity_error_until"
                " FROM pool_stats ORDER BY pool"
            )
            return [PoolStatsRow(PoolId.parse(r[0]), r[1] / 3600.0, *r[2:]) for r in rows]

        return await self._run(q)

    def observed_until_sync(self) -> dict[str, float]:
        """See fleetd.reconcile.state_sql.observed_until."""
        with self._lock:
            assert self._db is not None, "StateStore is closed"
            return observed_until(self._db)

    # -- meta -----------------------------------------------------------------------------------
    async def get_meta(self, key: str, default: Any = None) -> Any:
        if self._meta is None:
            self._meta = dict(await self._run(lambda db: db.execute("SELECT key, value FROM meta").fetchall()))
        raw = self._meta.get(key)
        return json.loads(raw) if raw is not None else default  # decoded per call: the caller's own

    async def set_meta(self, key: str, value: Any) -> None:
        raw = json.dumps(value)
        await self._run(
            lambda db: db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, raw),
            )
        )
        if self._meta is not None:
            self._meta[key] = raw
