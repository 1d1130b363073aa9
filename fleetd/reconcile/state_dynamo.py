"""The HA state backend: the reconcile loop's rows and the budget ledger in DynamoDB.

The leader keeps the whole state in memory (a write-through copy, fleetd.reconcile.state_mem)
and reads it from DynamoDB (strongly consistent) each time it takes the lease: nobody else can
have written since, because every write is fenced by the writer's lease generation
(fleetd.ha.table). A standby refreshes its copy every lease step (warm: status and a takeover
need no cold read). A write that fails for any reason drops the copy, so the next use reads the
store again instead of trusting rows the store may not hold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from fleetd.ha.table import DynamoTable, Fence
from fleetd.policy import ledger
from fleetd.policy.ledger import LedgerEvent, LedgerSummary
from fleetd.policy.model import Market, PoolId
from fleetd.reconcile.ledger_store import decode, encode
from fleetd.reconcile.state_mem import KINDS, StateModel
from fleetd.reconcile.state_rows import DrainRecord, InstanceRow, LaunchRow, PoolStatsRow, SeenInstance, SyncReport
from fleetd.shared.logs import get_logger

log = get_logger(__name__)

_T = TypeVar("_T")

LEDGER = "ledger"


class DynamoStateStore:
    """fleetd.reconcile.state_port.StateBackend on a DynamoDB table."""

    def __init__(self, table: DynamoTable, fence: Fence, *, persist: bool = True):
        """``persist=False``: a private copy for ``fleetd run --dry-run`` (the SQLite store's
        snapshot): it reads the shared state, and what the dry run records stays in memory."""
        self.table, self.fence, self.persist = table, fence, persist
        self._model: StateModel | None = None
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Read every row again (at a takeover, and each standby step)."""
        rows = {kind: await self.table.query(kind) for kind in KINDS}
        self._model = StateModel(rows)

    async def _read(self) -> StateModel:
        if self._model is None:
            await self.refresh()
        assert self._model is not None
        return self._model

    async def _mutate(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        async with self._lock:
            model = await self._read()
            if not self.persist:
                result = fn(model, *args, **kwargs)
                model.dirty.clear()
                return result
            self.fence.generation()  # a standby never changes its copy (raises LeaseLost)
            result = fn(model, *args, **kwargs)
            rows = [(kind, key, model.row(kind, key)) for kind, key in sorted(model.dirty)]
            model.dirty.clear()
            try:
                if rows:
                    await self.table.write(rows, self.fence)
            except BaseException:
                self._model = None
                raise
            return result

    # -- launches -------------------------------------------------------------------------------
    async def settled_launch_count(self) -> int:
        return (await self._read()).settled_launch_count()

    async def record_intent(self, **kwargs: Any) -> None:
        await self._mutate(StateModel.record_intent, **kwargs)

    async def settle_launch(
        self, token: str, status: str, instance_ids: Iterable[str], now: float, detail: str = ""
    ) -> None:
        await self._mutate(StateModel.settle_launch, token, status, list(instance_ids), now, detail)

    async def launches(self, status: str | None = None) -> list[LaunchRow]:
        return (await self._read()).launch_rows(status)

    async def unresolved_launches(self, since: float) -> list[LaunchRow]:
        return (await self._read()).unresolved_launches(since)

    async def launches_since(self, purpose: str, since: float) -> int:
        return (await self._read()).launches_since(purpose, since)

    # -- instances ------------------------------------------------------------------------------
    async def record_launched(self, seen: Sequence[SeenInstance], max_price_per_hour: float | None, now: float) -> None:
        await self._mutate(StateModel.record_launched, seen, max_price_per_hour, now)

    async def sync_instances(self, seen: Sequence[SeenInstance], now: float) -> SyncReport:
        return await self._mutate(StateModel.sync_instances, seen, now)

    async def instances(self, open_only: bool = True) -> list[InstanceRow]:
        return (await self._read()).instance_rows(open_only)

    async def instances_by_id(self, instance_ids: Sequence[str]) -> list[InstanceRow]:
        return (await self._read()).instance_rows(False, instance_ids)

    async def mark_terminate_requested(self, instance_ids: Sequence[str], now: float) -> None:
        await self._mutate(StateModel.mark_terminate_requested, instance_ids, now)

    async def record_notice(self, instance_id: str, at: float) -> bool:
        return await self._mutate(StateModel.record_notice, instance_id, at)

    # -- journal --------------------------------------------------------------------------------
    async def record_drain(self, instance_id: str, now: float, deadline: float | None, reason: str) -> DrainRecord:
        return await self._mutate(StateModel.record_drain, instance_id, now, deadline, reason)

    async def mark_drain_sent(self, instance_id: str, now: float) -> None:
        await self._mutate(StateModel.mark_drain_sent, instance_id, now)

    async def unsent_drains(self) -> list[DrainRecord]:
        return (await self._read()).unsent_drains()

    async def unfinished_terminations(self, before: float) -> list[str]:
        return (await self._read()).unfinished_terminations(before)

    # -- pools, meta ----------------------------------------------------------------------------
    async def mark_pool_unavailable(self, pool: PoolId, until: float, code: str, market: Market = Market.SPOT) -> None:
        await self._mutate(StateModel.mark_pool_unavailable, pool, until, code, market)

    async def pool_stats(self) -> list[PoolStatsRow]:
        return (await self._read()).pool_rows()

    async def get_meta(self, key: str, default: Any = None) -> Any:
        return (await self._read()).meta.get(key, default)

    async def set_meta(self, key: str, value: Any) -> None:
        await self._mutate(StateModel.set_meta, key, value)

    def observed_until_sync(self) -> dict[str, float]:
        m = self._model
        if m is None:
            return {}
        return {i: (r["ended_at"] if r["ended_at"] is not None else r["last_seen_at"]) for i, r in m.instances.items()}

    async def close(self) -> None:
        self._model = None


class DynamoLedger:
    """The budget ledger's events in the same table (fleetd.reconcile.ports.LedgerSink): stored
    once per event_id, in the order the leader appended them (sort key: a sequence number the
    leader continues from the stored ones; fencing keeps two leaders from numbering at once)."""

    def __init__(self, table: DynamoTable, fence: Fence):
        self.table, self.fence = table, fence
        self._events: list[LedgerEvent] | None = None
        self._ids: set[str] = set()
        self._next = 0
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        rows = await self.table.query(LEDGER)
        events: list[LedgerEvent] = []
        ids: set[str] = set()
        for key in sorted(rows):
            row = rows[key]
            if row.get("event_id"):
                ids.add(row["event_id"])
            try:
                events.append(decode(row["kind"], row["payload"]))
            except (ValueError, KeyError) as exc:
                log.warning("ledger_row_skipped", key=key, error=str(exc))
        self._events, self._ids = events, ids
        self._next = int(max(rows)) + 1 if rows else 0

    async def append(self, *events: LedgerEvent) -> int:
        async with self._lock:
            if self._events is None:
                await self.refresh()
            new: list[LedgerEvent] = []
            seen = set(self._ids)
            for e in events:
                if e.event_id and e.event_id in seen:
                    continue
                if e.event_id:
                    seen.add(e.event_id)
                new.append(e)
            rows = []
            for i, e in enumerate(new):
                kind, payload = encode(e)
                rows.append(
                    (
                        LEDGER,
                        f"{self._next + i:012d}",
                        {"kind": kind, "payload": payload, "event_id": e.event_id or None, "at": e.at},
                    )
                )
            try:
                if rows:
                    await self.table.write(rows, self.fence)
            except BaseException:
                self._events = None
                raise
            assert self._events is not None
            self._events.extend(new)
            self._ids = seen
            self._next += len(new)
            return len(new)

    async def events(self) -> list[LedgerEvent]:
        if self._events is None:
            await self.refresh()
        assert self._events is not None
        return list(self._events)

    async def summary(self, now: float, observed_until: dict[str, float] | None = None) -> LedgerSummary:
        return ledger.summarize(await self.events(), now, observed_until)

    async def spent_usd(self, now: float) -> float:
        return ledger.spend_usd(await self.events(), now)

    async def close(self) -> None:
        self._events = None
