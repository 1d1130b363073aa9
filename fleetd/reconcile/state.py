"""The reconcile loop's memory in ``<state_dir>/fleetd.db``: launches, instances, pool statistics.

What must survive a restart:
- **launches**, keyed by client token, written as an *intent* before CreateFleet is called and
  settled afterwards. An intent still open after a crash is resolved by the fleet's tags: its
  instances carry ``fleetd:launch=<token>``. Never a second purchase for one planned launch.
- **instances** fleetd has seen, with the price they were bought at, the bid, and whether fleetd
  itself terminated them (so a termination is not mistaken for an interruption).
- **pool statistics** (node-hours, notices, losses, capacity-error TTLs for spot and on-demand
  apart) that the placement policy learns interruption rates from.
- small loop memory (target node count, when spot became unavailable, ...) in ``meta``.

sqlite3 is blocking, so every call runs in a worker thread (one connection, one lock).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile import schema
from fleetd.reconcile import state_sql
from fleetd.reconcile.state_rows import (  # noqa: F401  (re-exported: callers use st.<Row>)
    ABANDONED,
    DrainRecord,
    FAILED,
    LAUNCHED,
    OPEN,
    TERMINAL,
    InstanceRow,
    LaunchRow,
    PoolStatsRow,
    SeenInstance,
    SyncReport,
)
from fleetd.reconcile.state_sql import (
    SCHEMA,
    accrue,
    close_instance,
    ensure_pool,
    observed_until,
)


class StateStore:
    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._private_dir: Path | None = None  # open_snapshot's copy, deleted on close

    # -- lifecycle ------------------------------------------------------------------------------
    @classmethod
    async def open(cls, state_dir: Path) -> "StateStore":
        store = cls(Path(state_dir) / "fleetd.db")
        await asyncio.to_thread(store._open)
        return store

    @classmethod
    async def open_snapshot(cls, state_dir: Path) -> "StateStore":
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

    async def _run(self, fn: Any, *args: Any) -> Any:
        def call() -> Any:
            with self._lock:
                assert self._db is not None, "StateStore is closed"
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    result = fn(self._db, *args)
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
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

        def tx(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE launches SET status=?, settled_at=?, detail='superseded by a new plan' "
                "WHERE status=? AND token != ?",
                (ABANDONED, now, OPEN, token),
            )
            db.execute(
                "INSERT OR IGNORE INTO launches (token, seq, planned_at, count, market, pools, purpose,"
                " max_price_per_hour, reason, status) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (token, seq, now, count, str(market), json.dumps([str(p) for p in pools]), purpose,
                 max_price_per_hour, reason, OPEN),
            )

        await self._run(tx)

    async def settle_launch(self, token: str, status: str, instance_ids: Iterable[str], now: float, detail: str = "") -> None:
        await self._run(
            lambda db: db.execute(
                "UPDATE launches SET status=?, instance_ids=?, settled_at=?, detail=? WHERE token=?",
                (status, json.dumps(sorted(instance_ids)), now, detail, token),
            )
        )

    async def launches(self, status: str | None = None) -> list[LaunchRow]:
        return await self._select_launches(" WHERE status=?" if status else "", (status,) if status else ())

    async def _select_launches(self, where: str, args: tuple) -> list[LaunchRow]:
        sql = ("SELECT token, seq, planned_at, count, market, pools, purpose, max_price_per_hour, status,"
               f" instance_ids, settled_at FROM launches{where} ORDER BY seq, planned_at")

        def q(db: sqlite3.Connection) -> list[LaunchRow]:
            return [
                LaunchRow(r[0], r[1], r[2], r[3], Market(r[4]), tuple(PoolId.parse(p) for p in json.loads(r[5])),
                          r[6], r[7], r[8], tuple(json.loads(r[9])), r[10])
                for r in db.execute(sql, args)
            ]

        return await self._run(q)

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

        def tx(db: sqlite3.Connection) -> None:
            for s in seen:
                db.execute(
                    "INSERT OR IGNORE INTO instances (instance_id, pool, market, price_per_hour,"
                    " max_price_per_hour, launched_at, launch_token, ec2_state, first_seen_at,"
                    " last_seen_at, accounted_until) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (s.instance_id, str(s.pool), str(s.market), s.price_per_hour, max_price_per_hour,
                     s.launched_at or now, s.launch_token, s.ec2_state, now, now, s.launched_at or now),
                )

        await self._run(tx)

    async def sync_instances(self, seen: Sequence[SeenInstance], now: float) -> SyncReport:
        """Fold one DescribeInstances answer into the table: adopt unknown instances, accrue
        node-hours per pool, and close instances that ended (counting losses)."""

        def tx(db: sqlite3.Connection) -> SyncReport:
            known = {r[0]: r for r in db.execute(
                "SELECT instance_id, accounted_until, terminate_requested_at, notice_at, pool, last_seen_at"
                " FROM instances WHERE ended_at IS NULL")}
            adopted, ended = [], []
            seen_ids = set()
            live: list[tuple[object, ...]] = []
            node_seconds: dict[str, float] = {}
            for s in seen:
                seen_ids.add(s.instance_id)
                row = known.get(s.instance_id)
                if row is None:
                    exists = db.execute("SELECT 1 FROM instances WHERE instance_id=?", (s.instance_id,)).fetchone()
                    if exists or s.ec2_state in TERMINAL:
                        continue  # already closed, or ended before we ever saw it alive
                    db.execute(
                        "INSERT INTO instances (instance_id, pool, market, price_per_hour, launched_at,"
                        " launch_token, ec2_state, first_seen_at, last_seen_at, accounted_until)"
                        " VALUES (?,?,?,?,?,?,?,?,?,?)",
                        (s.instance_id, str(s.pool), str(s.market), s.price_per_hour, s.launched_at,
                         s.launch_token, s.ec2_state, now, now, max(s.launched_at, 0.0) or now),
                    )
                    adopted.append(s.instance_id)
                    continue
                if s.ec2_state in TERMINAL:
                    # Billing stops when EC2 says it left running, not when fleetd noticed (a
                    # controller that was down for an hour must not bill that hour). Never before
                    # fleetd last saw it running (EC2's timestamp has one-second resolution).
                    end = now if s.ended_at is None else min(now, max(s.ended_at, row[5]))
                    accrue(db, s.instance_id, row[4], row[1], end)
                    reason = close_instance(db, s.instance_id, end, row[2], row[3], row[4], s.state_reason)
                    ended.append((s.instance_id, reason))
                else:
                    # accrue(), batched: every live instance is updated every pass (2,000 rows at
                    # 2,000 nodes), one statement for all of them and one per pool.
                    accounted = row[1]
                    if now > accounted:
                        node_seconds[row[4]] = node_seconds.get(row[4], 0.0) + (now - accounted)
                        accounted = now
                    # EC2's answer wins over what the launch reply said (pool, launch time).
                    live.append((s.ec2_state, now, s.launched_at or now, str(s.pool), accounted, s.instance_id))
            db.executemany("UPDATE instances SET ec2_state=?, last_seen_at=?, launched_at=?, pool=?,"
                           " accounted_until=? WHERE instance_id=?", live)
            for pool, secs in node_seconds.items():
                ensure_pool(db, pool)
                db.execute("UPDATE pool_stats SET node_seconds=node_seconds+? WHERE pool=?", (secs, pool))
            for iid, row in known.items():
                if iid not in seen_ids:
                    # Gone from DescribeInstances altogether (terminated long ago): when is not
                    # known, so it is billed only until fleetd last saw it.
                    end = min(now, row[5])
                    accrue(db, iid, row[4], row[1], end)
                    ended.append((iid, close_instance(db, iid, end, row[2], row[3], row[4], "")))
            return SyncReport(tuple(adopted), tuple(ended))

        return await self._run(tx)

    _INSTANCE_COLUMNS = (
        "instance_id, pool, market, price_per_hour, max_price_per_hour, launched_at, launch_token, ec2_state,"
        " first_seen_at, notice_at, drain_started_at, terminate_requested_at, ended_at, end_reason"
    )

    async def instances(self, open_only: bool = True) -> list[InstanceRow]:
        where = " WHERE ended_at IS NULL" if open_only else ""
        return await self._select_instances(where, ())

    async def instances_by_id(self, instance_ids: Sequence[str]) -> list[InstanceRow]:
        marks = ",".join("?" * len(instance_ids))
        return await self._select_instances(f" WHERE instance_id IN ({marks})", tuple(instance_ids))

    async def _select_instances(self, where: str, args: tuple) -> list[InstanceRow]:
        sql = f"SELECT {self._INSTANCE_COLUMNS} FROM instances{where} ORDER BY instance_id"
        return await self._run(
            lambda db: [InstanceRow(r[0], PoolId.parse(r[1]), Market(r[2]), *r[3:]) for r in db.execute(sql, args)]
        )

    async def mark_terminate_requested(self, instance_ids: Sequence[str], now: float) -> None:
        await self._run(lambda db: db.executemany(
            "UPDATE instances SET terminate_requested_at=COALESCE(terminate_requested_at, ?) WHERE instance_id=?",
            [(now, i) for i in instance_ids]))

    async def record_notice(self, instance_id: str, at: float) -> bool:
        """Count an interruption notice once per instance; True when it was new."""

        def tx(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT pool, notice_at FROM instances WHERE instance_id=?", (instance_id,)).fetchone()
            if row is None or row[1] is not None:
                return False
            db.execute("UPDATE instances SET notice_at=? WHERE instance_id=?", (at, instance_id))
            ensure_pool(db, row[0])
            db.execute("UPDATE pool_stats SET notices=notices+1, last_notice_at=MAX(COALESCE(last_notice_at,0),?)"
                       " WHERE pool=?", (at, row[0]))
            return True

        return await self._run(tx)

    # -- the drain/termination journal (fleetd.reconcile.journal) ------------------------------
    async def record_drain(self, instance_id: str, now: float, deadline: float | None, reason: str) -> DrainRecord:
        return await self._run(state_sql.record_drain, instance_id, now, deadline, reason)

    async def mark_drain_sent(self, instance_id: str, now: float) -> None:
        await self._run(lambda db: db.execute(
            "UPDATE instances SET drain_sent_at=COALESCE(drain_sent_at, ?) WHERE instance_id=?", (now, instance_id)))

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
                (code, until, str(pool)))

        await self._run(tx)

    async def pool_stats(self) -> list[PoolStatsRow]:
        def q(db: sqlite3.Connection) -> list[PoolStatsRow]:
            rows = db.execute("SELECT pool, node_seconds, notices, losses, capacity_errors, capacity_error_until,"
                              " last_error_code, last_notice_at, on_demand_capacity_error_until"
                              " FROM pool_stats ORDER BY pool")
            return [PoolStatsRow(PoolId.parse(r[0]), r[1] / 3600.0, *r[2:]) for r in rows]

        return await self._run(q)

    async def spend_estimate(self, now: float) -> float:
        """Spend at each instance's recorded price, 60 s minimum per instance. A stand-in until the
        budget ledger (fleetd.reconcile.ledger_store) is wired in as the loop's SpendSource."""

        def q(db: sqlite3.Connection) -> float:
            total = 0.0
            for price, start, end in db.execute("SELECT price_per_hour, launched_at, ended_at FROM instances"):
                total += price * max(60.0, (end if end is not None else now) - start) / 3600.0
            return total

        return await self._run(q)

    def observed_until_sync(self) -> dict[str, float]:
        """See fleetd.reconcile.state_sql.observed_until."""
        with self._lock:
            assert self._db is not None, "StateStore is closed"
            return observed_until(self._db)

    # -- meta -----------------------------------------------------------------------------------
    async def get_meta(self, key: str, default: Any = None) -> Any:
        row = await self._run(lambda db: db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone())
        return json.loads(row[0]) if row else default

    async def set_meta(self, key: str, value: Any) -> None:
        await self._run(lambda db: db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, json.dumps(value))))
