"""The state DB's schema and the SQL behind StateStore's calls: the steps several transactions share
(accrue node-hours, close an instance, fold a DescribeInstances answer in) and the launch table's
writes and reads (migrations are fleetd.reconcile.schema's). Runs inside the store's worker thread only."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.state_rows import ABANDONED, OPEN, TERMINAL, DrainRecord, LaunchRow, SeenInstance, SyncReport

SCHEMA = """
CREATE TABLE IF NOT EXISTS launches (
    token TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    planned_at REAL NOT NULL,
    count INTEGER NOT NULL,
    market TEXT NOT NULL,
    pools TEXT NOT NULL,              -- JSON list of "type@zone", ranked
    purpose TEXT NOT NULL DEFAULT 'capacity',
    max_price_per_hour REAL,
    reason TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL,             -- intent | launched | failed | abandoned
    instance_ids TEXT NOT NULL DEFAULT '[]',
    settled_at REAL,
    detail TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS launches_status ON launches(status);
CREATE TABLE IF NOT EXISTS instances (
    instance_id TEXT PRIMARY KEY,
    pool TEXT NOT NULL,
    market TEXT NOT NULL,
    price_per_hour REAL NOT NULL,
    max_price_per_hour REAL,
    launched_at REAL NOT NULL,
    launch_token TEXT,
    ec2_state TEXT NOT NULL,
    first_seen_at REAL NOT NULL,
    last_seen_at REAL NOT NULL,
    accounted_until REAL NOT NULL,    -- node-hours are accrued to the pool up to here
    notice_at REAL,
    drain_started_at REAL,
    terminate_requested_at REAL,
    ended_at REAL,
    end_reason TEXT
);
CREATE TABLE IF NOT EXISTS pool_stats (
    pool TEXT PRIMARY KEY,
    node_seconds REAL NOT NULL DEFAULT 0,
    notices INTEGER NOT NULL DEFAULT 0,
    losses INTEGER NOT NULL DEFAULT 0,
    capacity_errors INTEGER NOT NULL DEFAULT 0,
    capacity_error_until REAL,       -- spot capacity error TTL
    last_error_code TEXT,
    last_notice_at REAL,
    on_demand_capacity_error_until REAL  -- on-demand capacity error TTL (a separate shortage)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def ensure_pool(db: sqlite3.Connection, pool: str) -> None:
    db.execute("INSERT OR IGNORE INTO pool_stats (pool) VALUES (?)", (pool,))


def accrue(db: sqlite3.Connection, instance_id: str, pool: str, accounted_until: float, now: float) -> None:
    if now > accounted_until:
        ensure_pool(db, pool)
        db.execute("UPDATE pool_stats SET node_seconds=node_seconds+? WHERE pool=?", (now - accounted_until, pool))
        db.execute("UPDATE instances SET accounted_until=? WHERE instance_id=?", (now, instance_id))


def close_instance(
    db: sqlite3.Connection,
    instance_id: str,
    now: float,
    terminate_requested_at: float | None,
    notice_at: float | None,
    pool: str,
    state_reason: str,
) -> str:
    """End an instance's record. Ended without fleetd asking and without a notice: a loss."""
    if terminate_requested_at is not None:
        reason = "terminated by fleetd"
    elif notice_at is not None:
        reason = "interrupted after notice"
    else:
        reason = f"lost ({state_reason or 'no notice'})"
        ensure_pool(db, pool)
        db.execute("UPDATE pool_stats SET losses=losses+1 WHERE pool=?", (pool,))
    db.execute(
        "UPDATE instances SET ended_at=?, end_reason=?, ec2_state='terminated' WHERE instance_id=?",
        (now, reason, instance_id),
    )
    return reason


def observed_until(db: sqlite3.Connection) -> dict[str, float]:
    """Instance id -> the last time fleetd knew it was billed: its end when the end is known,
    else when fleetd last saw it alive. The ledger bills an instance with no recorded stop no
    further than this (fleetd.policy.ledger.bills), so a report read long after the controller
    stopped does not keep billing nodes nobody watches."""
    return {
        iid: (ended if ended is not None else seen)
        for iid, ended, seen in db.execute("SELECT instance_id, ended_at, last_seen_at FROM instances")
    }


# -- the drain/termination journal (fleetd.reconcile.journal) -------------------------------------
_DRAIN_COLUMNS = "instance_id, drain_started_at, drain_deadline, COALESCE(drain_reason, ''), drain_sent_at"


def record_drain(
    db: sqlite3.Connection, instance_id: str, now: float, deadline: float | None, reason: str
) -> DrainRecord:
    db.execute(
        "UPDATE instances SET drain_deadline=CASE WHEN drain_started_at IS NULL THEN ? ELSE drain_deadline END,"
        " drain_reason=CASE WHEN drain_started_at IS NULL THEN ? ELSE drain_reason END,"
        " drain_started_at=COALESCE(drain_started_at, ?) WHERE instance_id=?",
        (deadline, reason, now, instance_id),
    )
    r = db.execute(f"SELECT {_DRAIN_COLUMNS} FROM instances WHERE instance_id=?", (instance_id,)).fetchone()
    return (
        DrainRecord(*r) if r is not None and r[1] is not None else DrainRecord(instance_id, now, deadline, reason, None)
    )


def unsent_drains(db: sqlite3.Connection) -> list[DrainRecord]:
    rows = db.execute(
        f"SELECT {_DRAIN_COLUMNS} FROM instances WHERE drain_started_at IS NOT NULL AND drain_sent_at IS NULL"
        " AND ended_at IS NULL AND terminate_requested_at IS NULL ORDER BY instance_id"
    )
    return [DrainRecord(*r) for r in rows]


def unfinished_terminations(db: sqlite3.Connection, before: float) -> list[str]:
    return [
        r[0]
        for r in db.execute(
            "SELECT instance_id FROM instances WHERE terminate_requested_at IS NOT NULL AND terminate_requested_at < ?"
            " AND ended_at IS NULL AND ec2_state IN ('pending', 'running') ORDER BY instance_id",
            (before,),
        )
    ]


def sync_instances_tx(db: sqlite3.Connection, seen: Sequence[SeenInstance], now: float) -> tuple[SyncReport, bool]:
    """StateStore.sync_instances's transaction: adopt, accrue, close (see there). Also says
    whether a column an InstanceRow shows changed (an instance adopted or ended, EC2's state,
    launch time or pool of a live one): the pass's own bookkeeping (last seen, accounted until),
    written for every live instance every pass, is not such a change."""
    known = {
        r[0]: r
        for r in db.execute(
            "SELECT instance_id, accounted_until, terminate_requested_at, notice_at, pool, last_seen_at,"
            " ec2_state, launched_at FROM instances WHERE ended_at IS NULL"
        )
    }
    adopted, ended = [], []
    seen_ids = set()
    changed: list[tuple[object, ...]] = []
    live: list[str] = []
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
                (
                    s.instance_id,
                    str(s.pool),
                    str(s.market),
                    s.price_per_hour,
                    s.launched_at,
                    s.launch_token,
                    s.ec2_state,
                    now,
                    now,
                    max(s.launched_at, 0.0) or now,
                ),
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
            if now > row[1]:
                node_seconds[row[4]] = node_seconds.get(row[4], 0.0) + (now - row[1])
            live.append(s.instance_id)
            # EC2's answer wins over what the launch reply said (pool, launch time).
            ec2_says = (s.ec2_state, s.launched_at or now, str(s.pool))
            if ec2_says != (row[6], row[7], row[4]):
                changed.append((*ec2_says, s.instance_id))
    db.executemany("UPDATE instances SET ec2_state=?, launched_at=?, pool=? WHERE instance_id=?", changed)
    db.execute(
        "UPDATE instances SET last_seen_at=?, accounted_until=MAX(accounted_until, ?)"
        " WHERE instance_id IN (SELECT value FROM json_each(?))",
        (now, now, json.dumps(live)),
    )
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
    return SyncReport(tuple(adopted), tuple(ended)), bool(adopted or ended or changed)


def record_intent_tx(db: sqlite3.Connection, token: str, now: float, row: tuple[object, ...]) -> None:
    """The launch planned now (``row``: the launches table's columns, token to status), written
    before it is bought; every other open intent abandoned."""
    db.execute(
        "UPDATE launches SET status=?, settled_at=?, detail='superseded by a new plan' WHERE status=? AND token != ?",
        (ABANDONED, now, OPEN, token),
    )
    db.execute(
        "INSERT OR IGNORE INTO launches (token, seq, planned_at, count, market, pools, purpose,"
        " max_price_per_hour, reason, status) VALUES (?,?,?,?,?,?,?,?,?,?)",
        row,
    )


def select_launches(db: sqlite3.Connection, where: str, args: tuple[object, ...]) -> list[LaunchRow]:
    sql = (
        "SELECT token, seq, planned_at, count, market, pools, purpose, max_price_per_hour, status,"
        f" instance_ids, settled_at FROM launches{where} ORDER BY seq, planned_at"
    )
    return [
        LaunchRow(
            r[0],
            r[1],
            r[2],
            r[3],
            Market(r[4]),
            tuple(PoolId.parse(p) for p in json.loads(r[5])),
            r[6],
            r[7],
            r[8],
            tuple(json.loads(r[9])),
            r[10],
        )
        for r in db.execute(sql, args)
    ]


def record_launched_tx(
    db: sqlite3.Connection, seen: Sequence[SeenInstance], max_price_per_hour: float | None, now: float
) -> None:
    """Instances a launch returned (before DescribeInstances shows them)."""
    for s in seen:
        db.execute(
            "INSERT OR IGNORE INTO instances (instance_id, pool, market, price_per_hour,"
            " max_price_per_hour, launched_at, launch_token, ec2_state, first_seen_at,"
            " last_seen_at, accounted_until) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                s.instance_id,
                str(s.pool),
                str(s.market),
                s.price_per_hour,
                max_price_per_hour,
                s.launched_at or now,
                s.launch_token,
                s.ec2_state,
                now,
                now,
                s.launched_at or now,
            ),
        )
