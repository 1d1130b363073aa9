"""The state's rules on plain in-memory rows: what the SQL of fleetd/reconcile/state.py does,
for a backend that stores rows as items (fleetd/reconcile/state_dynamo.py).

Every mutation notes the rows it changed in ``dirty`` as (kind, key); the backend writes exactly
those (fenced) and clears it. Rows are dicts with the SQL columns' names, so both backends read
the same data the same way. Pure: no I/O, ``now`` passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.state_rows import (
    ABANDONED,
    LAUNCHED,
    OPEN,
    TERMINAL,
    DrainRecord,
    InstanceRow,
    LaunchRow,
    PoolStatsRow,
    SeenInstance,
    SyncReport,
)

LAUNCH, INSTANCE, POOL, META = "launch", "inst", "pool", "meta"
KINDS = (LAUNCH, INSTANCE, POOL, META)
Row = dict[str, Any]


def _instance(s: SeenInstance, now: float, max_price: float | None, accounted_until: float) -> Row:
    return dict(
        instance_id=s.instance_id,
        pool=str(s.pool),
        market=str(s.market),
        price_per_hour=s.price_per_hour,
        max_price_per_hour=max_price,
        launched_at=s.launched_at or now,
        launch_token=s.launch_token,
        ec2_state=s.ec2_state,
        first_seen_at=now,
        last_seen_at=now,
        accounted_until=accounted_until,
        notice_at=None,
        drain_started_at=None,
        terminate_requested_at=None,
        ended_at=None,
        end_reason=None,
        drain_deadline=None,
        drain_reason=None,
        drain_sent_at=None,
    )


class StateModel:
    def __init__(self, rows: dict[str, dict[str, Any]] | None = None):
        rows = rows or {}
        self.launches: dict[str, Row] = dict(rows.get(LAUNCH, {}))
        self.instances: dict[str, Row] = dict(rows.get(INSTANCE, {}))
        self.pools: dict[str, Row] = dict(rows.get(POOL, {}))
        self.meta: dict[str, Any] = dict(rows.get(META, {}))
        self.dirty: set[tuple[str, str]] = set()

    def row(self, kind: str, key: str) -> Any:
        return {LAUNCH: self.launches, INSTANCE: self.instances, POOL: self.pools, META: self.meta}[kind][key]

    # -- launches -------------------------------------------------------------------------------
    def settled_launch_count(self) -> int:
        return sum(1 for r in self.launches.values() if r["status"] != OPEN)

    def record_intent(
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
        for t, r in self.launches.items():
            if r["status"] == OPEN and t != token:
                r.update(status=ABANDONED, settled_at=now, detail="superseded by a new plan")
                self.dirty.add((LAUNCH, t))
        if token not in self.launches:
            self.launches[token] = dict(
                token=token,
                seq=seq,
                planned_at=now,
                count=count,
                market=str(market),
                pools=[str(p) for p in pools],
                purpose=purpose,
                max_price_per_hour=max_price_per_hour,
                reason=reason,
                status=OPEN,
                instance_ids=[],
                settled_at=None,
                detail="",
            )
            self.dirty.add((LAUNCH, token))

    def settle_launch(self, token: str, status: str, instance_ids: Iterable[str], now: float, detail: str = "") -> None:
        r = self.launches.get(token)
        if r is not None:
            r.update(status=status, instance_ids=sorted(instance_ids), settled_at=now, detail=detail)
            self.dirty.add((LAUNCH, token))

    def launch_rows(self, status: str | None = None) -> list[LaunchRow]:
        return self._launch_rows(lambda r: status is None or r["status"] == status)

    def unresolved_launches(self, since: float) -> list[LaunchRow]:
        return self._launch_rows(
            lambda r: (
                r["status"] == OPEN
                or (r["status"] == ABANDONED and not r["instance_ids"] and (r["settled_at"] or 0) >= since)
            )
        )

    def launches_since(self, purpose: str, since: float) -> int:
        return sum(
            1
            for r in self.launches.values()
            if r["purpose"] == purpose
            and r["status"] == LAUNCHED
            and r["settled_at"] is not None
            and r["settled_at"] >= since
        )

    def _launch_rows(self, keep: Any) -> list[LaunchRow]:
        rows = sorted((r for r in self.launches.values() if keep(r)), key=lambda r: (r["seq"], r["planned_at"]))
        return [
            LaunchRow(
                r["token"],
                r["seq"],
                r["planned_at"],
                r["count"],
                Market(r["market"]),
                tuple(PoolId.parse(p) for p in r["pools"]),
                r["purpose"],
                r["max_price_per_hour"],
                r["status"],
                tuple(r["instance_ids"]),
                r["settled_at"],
            )
            for r in rows
        ]

    # -- instances ------------------------------------------------------------------------------
    def record_launched(self, seen: Sequence[SeenInstance], max_price_per_hour: float | None, now: float) -> None:
        for s in seen:
            if s.instance_id not in self.instances:
                self.instances[s.instance_id] = _instance(s, now, max_price_per_hour, s.launched_at or now)
                self.dirty.add((INSTANCE, s.instance_id))

    def sync_instances(self, seen: Sequence[SeenInstance], now: float) -> SyncReport:
        """Same rules as StateStore.sync_instances (see there for why)."""
        known = {i: r for i, r in self.instances.items() if r["ended_at"] is None}
        adopted, ended, seen_ids = [], [], set()
        for s in seen:
            seen_ids.add(s.instance_id)
            row = known.get(s.instance_id)
            if row is None:
                if s.instance_id in self.instances or s.ec2_state in TERMINAL:
                    continue
                self.instances[s.instance_id] = _instance(s, now, None, max(s.launched_at, 0.0) or now)
                self.instances[s.instance_id]["launched_at"] = s.launched_at
                self.dirty.add((INSTANCE, s.instance_id))
                adopted.append(s.instance_id)
                continue
            if s.ec2_state in TERMINAL:
                end = now if s.ended_at is None else min(now, max(s.ended_at, row["last_seen_at"]))
                self._accrue(row, end)
                ended.append((s.instance_id, self._close(row, end, s.state_reason)))
            else:
                self._accrue(row, now)
                row.update(ec2_state=s.ec2_state, last_seen_at=now, launched_at=s.launched_at or now, pool=str(s.pool))
                self.dirty.add((INSTANCE, s.instance_id))
        for iid, row in known.items():
            if iid not in seen_ids:
                end = min(now, row["last_seen_at"])
                self._accrue(row, end)
                ended.append((iid, self._close(row, end, "")))
        return SyncReport(tuple(adopted), tuple(ended))

    def instance_rows(self, open_only: bool = True, ids: Sequence[str] | None = None) -> list[InstanceRow]:
        rows = [self.instances[i] for i in sorted(self.instances if ids is None else set(ids) & self.instances.keys())]
        return [
            InstanceRow(
                r["instance_id"],
                PoolId.parse(r["pool"]),
                Market(r["market"]),
                r["price_per_hour"],
                r["max_price_per_hour"],
                r["launched_at"],
                r["launch_token"],
                r["ec2_state"],
                r["first_seen_at"],
                r["notice_at"],
                r["drain_started_at"],
                r["terminate_requested_at"],
                r["ended_at"],
                r["end_reason"],
            )
            for r in rows
            if not open_only or r["ended_at"] is None
        ]

    def mark_terminate_requested(self, instance_ids: Sequence[str], now: float) -> None:
        for i in instance_ids:
            r = self.instances.get(i)
            if r is not None and r["terminate_requested_at"] is None:
                r["terminate_requested_at"] = now
                self.dirty.add((INSTANCE, i))

    def record_notice(self, instance_id: str, at: float) -> bool:
        r = self.instances.get(instance_id)
        if r is None or r["notice_at"] is not None:
            return False
        r["notice_at"] = at
        self.dirty.add((INSTANCE, instance_id))
        p = self._pool(r["pool"])
        p["notices"] += 1
        p["last_notice_at"] = max(p["last_notice_at"] or 0, at)
        return True

    # -- journal --------------------------------------------------------------------------------
    def record_drain(self, instance_id: str, now: float, deadline: float | None, reason: str) -> DrainRecord:
        r = self.instances.get(instance_id)
        if r is None:
            return DrainRecord(instance_id, now, deadline, reason, None)
        if r["drain_started_at"] is None:
            r.update(drain_started_at=now, drain_deadline=deadline, drain_reason=reason)
            self.dirty.add((INSTANCE, instance_id))
        return _drain(r)

    def mark_drain_sent(self, instance_id: str, now: float) -> None:
        r = self.instances.get(instance_id)
        if r is not None and r["drain_sent_at"] is None:
            r["drain_sent_at"] = now
            self.dirty.add((INSTANCE, instance_id))

    def unsent_drains(self) -> list[DrainRecord]:
        return [
            _drain(r)
            for _, r in sorted(self.instances.items())
            if r["drain_started_at"] is not None
            and r["drain_sent_at"] is None
            and r["ended_at"] is None
            and r["terminate_requested_at"] is None
        ]

    def unfinished_terminations(self, before: float) -> list[str]:
        return [
            i
            for i, r in sorted(self.instances.items())
            if r["terminate_requested_at"] is not None
            and r["terminate_requested_at"] < before
            and r["ended_at"] is None
            and r["ec2_state"] in ("pending", "running")
        ]

    # -- pools ----------------------------------------------------------------------------------
    def mark_pool_unavailable(self, pool: PoolId, until: float, code: str, market: Market = Market.SPOT) -> None:
        column = "capacity_error_until" if market is Market.SPOT else "on_demand_capacity_error_until"
        p = self._pool(str(pool))
        p["capacity_errors"] += 1
        p["last_error_code"] = code
        p[column] = max(p[column] or 0, until)

    def pool_rows(self) -> list[PoolStatsRow]:
        return [
            PoolStatsRow(
                PoolId.parse(k),
                p["node_seconds"] / 3600.0,
                p["notices"],
                p["losses"],
                p["capacity_errors"],
                p["capacity_error_until"],
                p["last_error_code"],
                p["last_notice_at"],
                p["on_demand_capacity_error_until"],
            )
            for k, p in sorted(self.pools.items())
        ]

    def set_meta(self, key: str, value: Any) -> None:
        self.meta[key] = value
        self.dirty.add((META, key))

    # -- shared steps (state_sql.py's accrue / close_instance / ensure_pool) --------------------
    def _pool(self, pool: str) -> Row:
        p = self.pools.get(pool)
        if p is None:
            p = self.pools[pool] = dict(
                node_seconds=0.0,
                notices=0,
                losses=0,
                capacity_errors=0,
                capacity_error_until=None,
                last_error_code=None,
                last_notice_at=None,
                on_demand_capacity_error_until=None,
            )
        self.dirty.add((POOL, pool))
        return p

    def _accrue(self, row: Row, now: float) -> None:
        if now > row["accounted_until"]:
            self._pool(row["pool"])["node_seconds"] += now - row["accounted_until"]
            row["accounted_until"] = now
            self.dirty.add((INSTANCE, row["instance_id"]))

    def _close(self, row: Row, now: float, state_reason: str) -> str:
        if row["terminate_requested_at"] is not None:
            reason = "terminated by fleetd"
        elif row["notice_at"] is not None:
            reason = "interrupted after notice"
        else:
            reason = f"lost ({state_reason or 'no notice'})"
            self._pool(row["pool"])["losses"] += 1
        row.update(ended_at=now, end_reason=reason, ec2_state="terminated")
        self.dirty.add((INSTANCE, row["instance_id"]))
        return reason


def _drain(r: Row) -> DrainRecord:
    return DrainRecord(
        r["instance_id"], r["drain_started_at"], r["drain_deadline"], r["drain_reason"] or "", r["drain_sent_at"]
    )
